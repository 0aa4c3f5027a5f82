"""Kernels for the CPU: paged attention, our GEMM for packed weights, C++ kernels built with inductor's toolchain,
and the allocator settings a CPU step needs."""
