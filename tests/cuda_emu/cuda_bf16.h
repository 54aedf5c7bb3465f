// Stands in for CUDA's cuda_bf16.h in the CPU emulation (see emu.h).
#pragma once
#include "emu.h"
