/* Prints the sizes and field offsets of the DLPack structs as compiled from the real header, one
 * `name value` pair per line, for tests/dlpack_layout.rs to compare with src/ffi/dlpack.rs. */
#include <stddef.h>
#include <stdio.h>
#include "dlpack.h"

#define SIZE(T) printf("sizeof.%s %zu\n", #T, sizeof(T))
#define ALIGN(T) printf("alignof.%s %zu\n", #T, _Alignof(T))
#define OFF(T, f) printf("offsetof.%s.%s %zu\n", #T, #f, offsetof(T, f))

int main(void) {
    printf("version.major %d\n", DLPACK_MAJOR_VERSION);
    printf("const.kDLCPU %d\n", (int)kDLCPU);
    printf("const.kDLCUDA %d\n", (int)kDLCUDA);
    printf("const.kDLCUDAHost %d\n", (int)kDLCUDAHost);
    printf("const.kDLROCM %d\n", (int)kDLROCM);
    printf("const.kDLCUDAManaged %d\n", (int)kDLCUDAManaged);
    printf("const.kDLInt %d\n", (int)kDLInt);
    printf("const.kDLUInt %d\n", (int)kDLUInt);
    printf("const.kDLFloat %d\n", (int)kDLFloat);
    printf("const.kDLBfloat %d\n", (int)kDLBfloat);
    printf("const.kDLBool %d\n", (int)kDLBool);
    printf("const.DLPACK_FLAG_BITMASK_READ_ONLY %llu\n",
           (unsigned long long)DLPACK_FLAG_BITMASK_READ_ONLY);
    printf("sizeof.DLDeviceType %zu\n", sizeof(DLDeviceType));

    SIZE(DLDevice); ALIGN(DLDevice);
    OFF(DLDevice, device_type); OFF(DLDevice, device_id);

    SIZE(DLDataType); ALIGN(DLDataType);
    OFF(DLDataType, code); OFF(DLDataType, bits); OFF(DLDataType, lanes);

    SIZE(DLTensor); ALIGN(DLTensor);
    OFF(DLTensor, data); OFF(DLTensor, device); OFF(DLTensor, ndim); OFF(DLTensor, dtype);
    OFF(DLTensor, shape); OFF(DLTensor, strides); OFF(DLTensor, byte_offset);

    SIZE(DLManagedTensor); ALIGN(DLManagedTensor);
    OFF(DLManagedTensor, dl_tensor); OFF(DLManagedTensor, manager_ctx);
    OFF(DLManagedTensor, deleter);

    SIZE(DLPackVersion); ALIGN(DLPackVersion);
    OFF(DLPackVersion, major); OFF(DLPackVersion, minor);

    SIZE(DLManagedTensorVersioned); ALIGN(DLManagedTensorVersioned);
    OFF(DLManagedTensorVersioned, version); OFF(DLManagedTensorVersioned, manager_ctx);
    OFF(DLManagedTensorVersioned, deleter); OFF(DLManagedTensorVersioned, flags);
    OFF(DLManagedTensorVersioned, dl_tensor);
    return 0;
}
