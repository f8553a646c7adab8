// Build script to run nvcc and generate the C glue code for launching the flash-attention kernel.
// The cuda build time is very long so one can set the CANDLE_FLASH_ATTN_BUILD_DIR environment
// variable in order to cache the compiled artifacts and avoid recompiling too often.
use cudaforge::{KernelBuilder, Result};
use std::{fs, path::PathBuf};
const CUTLASS_COMMIT: &str = "7d49e6c7e2f8896c47f586706e67e1fb215529dc";

// harpe: trimmed to what harpe calls (HARPE.md): head dims 64 and 128, bf16/fp16, causal or not; no split-KV
// (paged) kernels. The 0.11.1 crate lists 53 files. Beside them FA2's own backward (FlashAttention 2.8.3's
// flash_bwd_* files), causal only: what training needs.
const KERNEL_FILES: [&str; 13] = [
    "kernels/flash_api.cu",
    "kernels/flash_bwd_hdim64_bf16_causal_sm80.cu",
    "kernels/flash_bwd_hdim64_fp16_causal_sm80.cu",
    "kernels/flash_bwd_hdim128_bf16_causal_sm80.cu",
    "kernels/flash_bwd_hdim128_fp16_causal_sm80.cu",
    "kernels/flash_fwd_hdim64_bf16_sm80.cu",
    "kernels/flash_fwd_hdim64_bf16_causal_sm80.cu",
    "kernels/flash_fwd_hdim64_fp16_sm80.cu",
    "kernels/flash_fwd_hdim64_fp16_causal_sm80.cu",
    "kernels/flash_fwd_hdim128_bf16_sm80.cu",
    "kernels/flash_fwd_hdim128_bf16_causal_sm80.cu",
    "kernels/flash_fwd_hdim128_fp16_sm80.cu",
    "kernels/flash_fwd_hdim128_fp16_causal_sm80.cu",
];

const HEADER_FILES: [&str; 22] = [
    "kernels/alibi.h",
    "kernels/block_info.h",
    "kernels/dropout.h",
    "kernels/error.h",
    "kernels/flash.h",
    "kernels/flash_bwd_kernel.h",
    "kernels/flash_bwd_launch_template.h",
    "kernels/flash_bwd_preprocess_kernel.h",
    "kernels/flash_fwd_kernel.h",
    "kernels/flash_fwd_launch_template.h",
    "kernels/hardware_info.h",
    "kernels/kernel_helpers.h",
    "kernels/kernel_traits.h",
    "kernels/kernel_traits_sm90.h",
    "kernels/kernels.h",
    "kernels/mask.h",
    "kernels/namespace_config.h",
    "kernels/philox.cuh",
    "kernels/rotary.h",
    "kernels/softmax.h",
    "kernels/static_switch.h",
    "kernels/utils.h",
];

fn update_hash(hash: &mut u64, bytes: &[u8]) {
    const FNV_PRIME: u64 = 1099511628211;
    for &byte in bytes {
        *hash ^= u64::from(byte);
        *hash = hash.wrapping_mul(FNV_PRIME);
    }
}

fn header_hash() -> Result<u64> {
    let mut hash = 14695981039346656037;
    for file in HEADER_FILES {
        update_hash(&mut hash, file.as_bytes());
        update_hash(&mut hash, &fs::read(file)?);
    }
    Ok(hash)
}

fn main() -> Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    for kernel_file in KERNEL_FILES.iter() {
        println!("cargo::rerun-if-changed={kernel_file}");
    }
    for header_file in HEADER_FILES.iter() {
        println!("cargo::rerun-if-changed={header_file}");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR not set"));
    let build_dir = match std::env::var("CANDLE_FLASH_ATTN_BUILD_DIR") {
        Err(_) =>
        {
            #[allow(clippy::redundant_clone)]
            out_dir.clone()
        }
        Ok(build_dir) => {
            let path = PathBuf::from(build_dir);
            path.canonicalize().expect(&format!(
                "Directory doesn't exists: {} (the current directory is {})",
                &path.display(),
                std::env::current_dir()?.display()
            ))
        }
    };

    let kernels: Vec<_> = KERNEL_FILES.iter().collect();
    let header_hash_arg = format!("-DCANDLE_FLASH_ATTN_HEADER_HASH=0x{:016x}", header_hash()?);
    let mut builder = KernelBuilder::new()
        .source_files(kernels)
        .out_dir(&build_dir)
        .with_cutlass(Some(CUTLASS_COMMIT)) // ✅ Auto-fetch and include CUTLASS from GitHub
        .arg("-std=c++17")
        .arg("-O3")
        .arg("-U__CUDA_NO_HALF_OPERATORS__")
        .arg("-U__CUDA_NO_HALF_CONVERSIONS__")
        .arg("-U__CUDA_NO_HALF2_OPERATORS__")
        .arg("-U__CUDA_NO_BFLOAT16_CONVERSIONS__")
        .arg("--expt-relaxed-constexpr")
        .arg("--expt-extended-lambda")
        .arg("--use_fast_math")
        .arg("--verbose")
        .arg(&header_hash_arg)
        .thread_percentage(0.5); // Use up to 50% of available threads

    // harpe: SASS for Hopper beside the CUDA_COMPUTE_CAP one (cudaforge adds that one, 80 for the A100 by
    // default). These FA2 kernels are compiled to SASS only (no PTX for the driver to JIT), so a build for 80
    // alone has no code an H100/H200 can run: every launch there failed with "no kernel image". sm_80 code does
    // not run on sm_90; compiling both doubles this build's time, which a GPU run cannot make up for.
    let cap: usize = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .and_then(|c| c.trim().chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse().ok())
        .unwrap_or(80);
    if cap < 90 {
        builder = builder.arg("-gencode=arch=compute_90,code=sm_90");
    }

    let mut is_target_msvc = false;
    if let Ok(target) = std::env::var("TARGET") {
        if target.contains("msvc") {
            is_target_msvc = true;
            builder = builder.arg("-D_USE_MATH_DEFINES");
        }
    }

    if !is_target_msvc {
        builder = builder.arg("-Xcompiler").arg("-fPIC");
    }

    let out_file = build_dir.join("libflashattention.a");
    builder.build_lib(out_file)?;

    println!("cargo::rustc-link-search={}", build_dir.display());
    println!("cargo::rustc-link-lib=flashattention");
    println!("cargo::rustc-link-lib=dylib=cudart");
    if !is_target_msvc {
        println!("cargo::rustc-link-lib=dylib=stdc++");
    }
    Ok(())
}
