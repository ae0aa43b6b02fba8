// Internal: marks functions compiled for both the host and CUDA devices (plain functions without nvcc).
#pragma once

#if defined(__CUDACC__)
#define MOEKIT_HOST_DEVICE __host__ __device__
#define MOEKIT_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define MOEKIT_HOST_DEVICE
#define MOEKIT_HOST_DEVICE_INLINE inline
#endif
