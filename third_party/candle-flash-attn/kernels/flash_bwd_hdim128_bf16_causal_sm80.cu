// Copyright (c) 2024, Tri Dao.
// Splitting the different head dimensions to different files to speed up compilation.
// This file is auto-generated. See "generate_kernels.py"
#include "namespace_config.h"
#include "flash_bwd_launch_template.h"

// harpe: specialized at global scope, where this copy's flash.h declares run_mha_bwd_ (upstream's flash.h
// declares it inside FLASH_NAMESPACE, and so does its copy of this file).
template<>
void run_mha_bwd_<cutlass::bfloat16_t, 128, true>(Flash_bwd_params &params, cudaStream_t stream) {
    FLASH_NAMESPACE::run_mha_bwd_hdim128<cutlass::bfloat16_t, true>(params, stream);
}
