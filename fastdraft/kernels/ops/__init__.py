"""One op table per kernel family: a plain PyTorch reference, fastdraft's C++ kernel on a CPU
and the Triton kernel on a GPU, chosen by the tensors' device. The reference defines the
semantics; the tests compare every implementation with it."""
