"""The lowest layer: request settings (`settings`), the drafter kinds (`registry`), the shipped checkpoints,
interleaved timing, the machine's memory, XLA's options, and safe tensor-file reading. Imports no other jspec
package."""
