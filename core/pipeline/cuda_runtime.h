/* The CUDA runtime, loaded at run time: byteps builds and imports without CUDA, and a GPU job loads the
 * libcudart that its framework brings (BYTEPS_CUDART, default: torch's; core/gpu.py cudart_path()).
 * Tests load a fake runtime with the same symbols (tests/fake_cudart/fake_cudart.c).
 *
 * Only what the copy stages use is looked up; the signatures and values are the CUDA runtime API's. */
#ifndef BPS_CUDA_RUNTIME_H
#define BPS_CUDA_RUNTIME_H

#include <stddef.h>

#include <string>

#include "core/pipeline/dl_library.h"

typedef int bps_cuda_error;                /* cudaError_t */
typedef void *bps_cuda_stream;             /* cudaStream_t */
typedef void *bps_cuda_event;              /* cudaEvent_t */

static const int BPS_CUDA_MEMCPY_H2D = 1;  /* cudaMemcpyHostToDevice */
static const int BPS_CUDA_MEMCPY_D2H = 2;  /* cudaMemcpyDeviceToHost */
static const unsigned BPS_CUDA_STREAM_NON_BLOCKING = 0x01; /* cudaStreamNonBlocking: no sync with stream 0 */
/* cudaEventBlockingSync | cudaEventDisableTiming: a waiting host thread sleeps instead of spinning */
static const unsigned BPS_CUDA_EVENT_FLAGS = 0x01 | 0x02;
static const unsigned BPS_CUDA_HOST_ALLOC_PORTABLE = 0x01; /* cudaHostAllocPortable: pinned for every context */

struct BpsCudart : BpsDlLibrary {
    BpsCudart() : BpsDlLibrary("the CUDA runtime", "CUDA") {}
    bps_cuda_error (*SetDevice)(int) = nullptr;
    bps_cuda_error (*StreamCreateWithFlags)(bps_cuda_stream *, unsigned) = nullptr;
    bps_cuda_error (*StreamDestroy)(bps_cuda_stream) = nullptr;
    bps_cuda_error (*EventCreateWithFlags)(bps_cuda_event *, unsigned) = nullptr;
    bps_cuda_error (*EventDestroy)(bps_cuda_event) = nullptr;
    bps_cuda_error (*EventRecord)(bps_cuda_event, bps_cuda_stream) = nullptr;
    bps_cuda_error (*EventSynchronize)(bps_cuda_event) = nullptr;
    bps_cuda_error (*StreamWaitEvent)(bps_cuda_stream, bps_cuda_event, unsigned) = nullptr;
    bps_cuda_error (*MemcpyAsync)(void *, const void *, size_t, int, bps_cuda_stream) = nullptr;
    bps_cuda_error (*HostAlloc)(void **, size_t, unsigned) = nullptr;
    bps_cuda_error (*FreeHost)(void *) = nullptr;

    /* dlopen ``path`` and look up every function; "" on success, else why not */
    std::string load(const std::string &path) {
        std::string err = open(path);
        if (!err.empty()) return err;
        find(&SetDevice, "cudaSetDevice");
        find(&StreamCreateWithFlags, "cudaStreamCreateWithFlags");
        find(&StreamDestroy, "cudaStreamDestroy");
        find(&EventCreateWithFlags, "cudaEventCreateWithFlags");
        find(&EventDestroy, "cudaEventDestroy");
        find(&EventRecord, "cudaEventRecord");
        find(&EventSynchronize, "cudaEventSynchronize");
        find(&StreamWaitEvent, "cudaStreamWaitEvent");
        find(&MemcpyAsync, "cudaMemcpyAsync");
        find(&HostAlloc, "cudaHostAlloc");
        find(&FreeHost, "cudaFreeHost");
        find(&GetErrorString, "cudaGetErrorString");
        return complete(path);
    }
};

#endif
