// The CUDA devices this process can use, for the daemon's --devices. Only a build with CUDA
// (the NCCL build: Bazel --define=rannc_nccl=1, CMake -DRANNC_WITH_NCCL=ON) sees any; the
// default build reports none.
#ifndef RANNC_DAEMON_COMM_CUDA_DEVICES_H_
#define RANNC_DAEMON_COMM_CUDA_DEVICES_H_

#include <cstdint>

namespace rannc {
namespace comm {

// 0 without CUDA in the build, without a driver, or without devices.
int CudaDeviceCount();

// Device `index`'s total memory in bytes (0 when it cannot be read).
uint64_t CudaDeviceMemory(int index);

// Page-locks host memory the process allocated (cudaHostRegister), so that copies between it
// and the devices run asynchronously at the link's speed; false without CUDA or when the
// driver refuses. CudaHostUnregister undoes it.
bool CudaHostRegister(void* ptr, uint64_t bytes);
void CudaHostUnregister(void* ptr);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_CUDA_DEVICES_H_
