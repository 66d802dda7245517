/* A stand-in for the CUDA driver, libcuda.so.1, that runs nothing: every call Triton's launcher and module
 * loader make succeeds at once, and the device it describes is an sm_90 GPU with 132 multiprocessors (an H100's
 * and H200's figures). bench/stub_driver.py builds it with the C compiler Triton uses and loads it in place of
 * the driver, so that Triton's own launch path runs on a machine without a GPU. Built against Triton's cuda.h. */
#include <stddef.h>
#include <string.h>
#include "cuda.h"

CUresult CUDAAPI cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int *version) { *version = 13000; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorString(CUresult error, const char **text) { *text = "fake CUDA driver"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  switch (attribute) {
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 232448; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *value = 233472; break;
  case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; break;
  case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *value = 1980000; break;
  case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *value = 2619000; break;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; break;
  default: *value = 0;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) { *context = (CUcontext)1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *context) { *context = (CUcontext)1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) { *module = (CUmodule)1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleUnload(CUmodule module) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
  *function = (CUfunction)1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction function) {
  *value = attribute == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction function, CUfunction_attribute attribute, int value) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction function, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *clusters, CUfunction function, const CUlaunchConfig *config) {
  *clusters = 1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr pointer) {
  if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = pointer;
  return CUDA_SUCCESS;
}
#undef cuLaunchKernelEx
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction function, void **parameters, void **extra) {
  return CUDA_SUCCESS;
}
