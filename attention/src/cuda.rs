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
    "silu_mul_stacked",
    "kv_append",
    "f32_to_half",
    "sparse_attention_split",
    "combine_splits",
    "gather_copy",
    "copy_tokens",
    "sample_rows",
    "qkv_finish",
    "merge_self",
    "rms_norm_half",
    "silu_mul_stacked_half",
    "sketch_lse",
    "sketch_shares",
    "top_blocks",
    "place_picks",
    "scatter_runs",
    "row_max_parts",
    "row_sum_parts",
    "attend_warps_g1_d64",
    "attend_warps_g2_d64",
    "attend_warps_g3_d64",
    "attend_warps_g4_d64",
    "attend_warps_g5_d64",
    "attend_warps_g6_d64",
    "attend_warps_g7_d64",
    "attend_warps_g8_d64",
    "attend_warps_g1_d128",
    "attend_warps_g2_d128",
    "attend_warps_g3_d128",
    "attend_warps_g4_d128",
    "attend_warps_g5_d128",
    "attend_warps_g6_d128",
    "attend_warps_g7_d128",
    "attend_warps_g8_d128",
    "attend_warps_g1_d64_b16",
    "attend_warps_g2_d64_b16",
    "attend_warps_g3_d64_b16",
    "attend_warps_g4_d64_b16",
    "attend_warps_g5_d64_b16",
    "attend_warps_g6_d64_b16",
    "attend_warps_g7_d64_b16",
    "attend_warps_g8_d64_b16",
    "attend_warps_g1_d128_b16",
    "attend_warps_g2_d128_b16",
    "attend_warps_g3_d128_b16",
    "attend_warps_g4_d128_b16",
    "attend_warps_g5_d128_b16",
    "attend_warps_g6_d128_b16",
    "attend_warps_g7_d128_b16",
    "attend_warps_g8_d128_b16",
    "gemv_b1",
    "gemv_b2",
    "gemv_b3",
    "gemv_b4",
    "gemv_b5",
    "gemv_b6",
    "gemv_b7",
    "gemv_b8",
    "gemv_tc",
    "attend_tc_d64",
    "attend_tc_d128",
    "attend_tc_d64_b16",
    "attend_tc_d128_b16",
];

/// Words of one row's spec for `sample_rows`.
pub const SAMPLE_SPEC_WORDS: usize = 6;
/// Words of one row's result from `sample_rows`.
pub const SAMPLE_OUT_WORDS: usize = 4 + 2 * SAMPLE_TOP;
/// Top log-probabilities `sample_rows` reports at most.
pub const SAMPLE_TOP: usize = 20;
/// Threads of one `sample_rows` block (its reductions assume this power of two).
pub const SAMPLE_THREADS: u32 = 1024;
/// Logits of a row one `row_max_parts`/`row_sum_parts` CUDA block takes: a row's first two
/// passes spread over the device, where one `sample_rows` block made them alone.
pub const PART_LOGITS: usize = 4096;
/// Threads of one `row_max_parts`/`row_sum_parts` block (their reductions assume a power of
/// two).
pub const PART_THREADS: u32 = 256;
/// Threads of one `rms_norm`/`rms_norm_half` block, a row's (the most the kernels take).
pub const NORM_THREADS: u32 = 1024;
