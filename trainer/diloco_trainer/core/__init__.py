"""The algorithm, pure and synchronous: merging pseudo-gradients, the outer optimizer, codecs with
error feedback, published updates, fragments and tensor bodies. Torch, no I/O, no HTTP."""
