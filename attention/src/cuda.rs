//! Device kernels (CUDA C for NVRTC). The CUDA backend in `decode-node` compiles them at run
//! time; the layouts and the base-2 log-sum-exp match the CPU side exactly.

/// Source of every device kernel.
pub const KERNELS_CU: &str = include_str!("cuda/kernels.cu");

/// The `extern "C"` entry points [`KERNELS_CU`] defines.
pub const ENTRY_POINTS: &[&str] = &[
    "quest_scores",
    "lse2_merge",
    "rms_norm",
    "rope",
    "silu_mul",
    "kv_append",
    "f32_to_half",
    "sparse_attention_split",
    "combine_splits",
    "gather_copy",
    "copy_tokens",
];
