// Stands in for CUDA's cuda_runtime_api.h in the CPU emulation (see emu.h).
#pragma once
#include "emu.h"
