"""Pallas attention kernels for TPUs and GPUs, with the contract of the reference loop in
`jspec.model.attention`."""
