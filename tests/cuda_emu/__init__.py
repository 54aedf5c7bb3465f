"""A CPU emulation of CUDA for running csrc/ kernels without a GPU (see emu.h, build.py)."""
