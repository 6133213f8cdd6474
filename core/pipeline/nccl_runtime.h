/* NCCL, loaded at run time like the CUDA runtime (cuda_runtime.h): byteps builds and imports without it,
 * and a GPU job loads the libnccl its framework brings (BYTEPS_NCCL, default: PyTorch's nvidia-nccl
 * wheel; core/device_buffer.py nccl_path()). Tests load a fake with the same symbols
 * (tests/fake_cudart/fake_cudart.c, which is also their CUDA runtime).
 *
 * Only what the NCCL stages use is looked up; signatures and values are nccl.h's (NCCL 2.x). */
#ifndef BPS_NCCL_RUNTIME_H
#define BPS_NCCL_RUNTIME_H

#include <stddef.h>

#include <string>

#include "core/kernels/bps_dtypes.h"
#include "core/pipeline/cuda_runtime.h"
#include "core/pipeline/dl_library.h"

typedef int bps_nccl_result;       /* ncclResult_t */
typedef void *bps_nccl_comm;       /* ncclComm_t */
static const int BPS_NCCL_SUM = 0; /* ncclSum */
static const int BPS_NCCL_ID_BYTES = 128;
struct BpsNcclId {                 /* ncclUniqueId */
    char internal[BPS_NCCL_ID_BYTES];
};

/* ncclDataType_t of a byteps dtype code (core/kernels/bps_dtypes.h), -1 for none */
static inline int bps_nccl_dtype(int dtype) {
    switch (dtype) {
        case BPS_INT8: return 0;
        case BPS_UINT8: return 1;
        case BPS_INT32: return 2;
        case BPS_INT64: return 4;
        case BPS_FLOAT16: return 6;
        case BPS_FLOAT32: return 7;
        case BPS_FLOAT64: return 8;
        case BPS_BFLOAT16: return 9;
        default: return -1;
    }
}

struct BpsNccl : BpsDlLibrary {
    BpsNccl() : BpsDlLibrary("NCCL", "NCCL") {}
    bps_nccl_result (*GetUniqueId)(BpsNcclId *) = nullptr;
    bps_nccl_result (*CommInitRank)(bps_nccl_comm *, int, BpsNcclId, int) = nullptr;
    bps_nccl_result (*CommAbort)(bps_nccl_comm) = nullptr;
    bps_nccl_result (*Reduce)(const void *, void *, size_t, int, int, int, bps_nccl_comm, bps_cuda_stream) = nullptr;
    bps_nccl_result (*Broadcast)(const void *, void *, size_t, int, int, bps_nccl_comm, bps_cuda_stream) = nullptr;

    /* dlopen ``path`` and look up every function; "" on success, else why not */
    std::string load(const std::string &path) {
        std::string err = open(path);
        if (!err.empty()) return err;
        find(&GetUniqueId, "ncclGetUniqueId");
        find(&CommInitRank, "ncclCommInitRank");
        find(&CommAbort, "ncclCommAbort");
        find(&Reduce, "ncclReduce");
        find(&Broadcast, "ncclBroadcast");
        find(&GetErrorString, "ncclGetErrorString");
        return complete(path);
    }
};

#endif
