"""What a deployment needs before it runs: the memory plan (`memory`), XLA's own figures for programs of given
shapes (`shaped`), programs compiled for accelerators that are not here (`accelerators`), and the cost model
measured on this one (`calibration`). Imports every layer up to `jspec.decoding`."""
