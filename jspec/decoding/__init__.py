"""The decode loop: a target and a drafter made one program (`decoder`), the batch it takes (`batches`), the
state and the loop (`loop`), rows decoded and refilled in a running batch (`rows`), and the compiled programs
(`programs`, `executables`). Imports every layer up to `jspec.drafters`."""
