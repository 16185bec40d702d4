/* A stand-in for the CUDA driver (libcuda.so.1) on a host without a GPU.
 *
 * Mosaic GPU's compiler (MosaicGpuCompile in the CUDA PJRT plugin) asks the
 * driver for the current device's compute capability, then compiles
 * MLIR -> PTX -> SASS with ptxas, then loads the module.  This library
 * answers the questions as an H200 (sm_90) would and fails the load, so
 * that ptxas's report (registers, spills, warnings) and the PTX/SASS dumps
 * can be had on a CPU-only host.  Nothing here can run a kernel.
 */
#include <stdio.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;

static int context;
static const char kError[] = "stand-in CUDA driver: no device";

CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return 0; }
CUresult cuCtxGetCurrent(CUcontext *ctx) { *ctx = &context; return 0; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return 0; }
CUresult cuCtxPushCurrent(CUcontext ctx) { return 0; }
CUresult cuCtxPopCurrent(CUcontext *ctx) {
  if (ctx) *ctx = &context;
  return 0;
}
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = 0; return 0; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return 0; }
CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
  snprintf(name, len, "stand-in sm_90");
  return 0;
}
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
  switch (attribute) {
    case 75: *value = 9; break;        /* compute capability, major */
    case 76: *value = 0; break;        /* compute capability, minor */
    case 16: *value = 132; break;      /* multiprocessors */
    case 97: *value = 232448; break;   /* shared memory per block, opt-in */
    default: *value = 0;
  }
  return 0;
}
CUresult cuGetErrorString(CUresult error, const char **text) {
  *text = kError;
  return 0;
}
CUresult cuGetErrorName(CUresult error, const char **text) {
  *text = "CUDA_ERROR_NO_DEVICE";
  return 0;
}
CUresult cuModuleLoadData(void **module, const void *image) { return 100; }
