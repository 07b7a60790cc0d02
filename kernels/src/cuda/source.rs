//! The kernel sources, embedded at build time and compiled as one NVRTC program.

/// (file name, text) in the order they are concatenated; `pdl.cuh` and `common.cuh` first.
pub const SOURCES: &[(&str, &str)] = &[
    ("pdl.cuh", include_str!("../../cuda/pdl.cuh")),
    ("silu.cuh", include_str!("../../cuda/silu.cuh")),
    ("common.cuh", include_str!("../../cuda/common.cuh")),
    ("matmul.cu", include_str!("../../cuda/matmul.cu")),
    ("norm.cu", include_str!("../../cuda/norm.cu")),
    ("elementwise.cu", include_str!("../../cuda/elementwise.cu")),
    ("rope.cu", include_str!("../../cuda/rope.cu")),
    (
        "paged_attention.cu",
        include_str!("../../cuda/paged_attention.cu"),
    ),
    (
        "paged_attention_wide.cu",
        include_str!("../../cuda/paged_attention_wide.cu"),
    ),
    (
        "paged_attention_par.cu",
        include_str!("../../cuda/paged_attention_par.cu"),
    ),
    ("wgmma.cuh", include_str!("../../cuda/wgmma.cuh")),
    (
        "paged_attention_wg.cu",
        include_str!("../../cuda/paged_attention_wg.cu"),
    ),
    ("rowstats.cu", include_str!("../../cuda/rowstats.cu")),
    ("select.cu", include_str!("../../cuda/select.cu")),
    ("moe.cu", include_str!("../../cuda/moe.cu")),
];

/// Every kernel entry point the module must export (checked when it is loaded).
pub const KERNELS: &[&str] = &[
    "f32_to_bf16_kernel",
    "tree_matmul_leaf",
    "tree_combine",
    "rms_norm_kernel",
    "rms_norm_warp_kernel",
    "add_rms_norm_kernel",
    "silu_mul_kernel",
    "silu_mul_pairs_kernel",
    "row_stats_kernel",
    "top_k_select_kernel",
    "masked_draw_kernel",
    "masked_draw_combine_kernel",
    "copy_cols_kernel",
    "cut_to_bf16_kernel",
    "add_row_bias_kernel",
    "add_assign_kernel",
    "embedding_kernel",
    "select_rows_kernel",
    "interleave_cols_kernel",
    "kv_write_kernel",
    "rope_kernel",
    "qkv_rope_kv_kernel",
    "qkv_rope_kv4_kernel",
    "pa_prefill_hd16",
    "pa_prefill_hd32",
    "pa_prefill_hd64",
    "pa_prefill_hd128",
    "pa_prefill96_hd16",
    "pa_prefill96_hd32",
    "pa_prefill96_hd64",
    "pa_prefill96_hd128",
    "pa_prefill_wg_hd64",
    "pa_prefill_wg_hd128",
    "pa_decode_hd16",
    "pa_decode_hd32",
    "pa_decode_hd64",
    "pa_decode_hd128",
    "pa_decode_hd256",
    "pa_decode1_hd16",
    "pa_decode1_hd32",
    "pa_decode1_hd64",
    "pa_decode1_hd128",
    "pa_decode1_hd256",
    "pa_decode_wide_hd64",
    "pa_decode_wide_hd128",
    "pa_decode_par_hd128",
    "pa_combine",
    "moe_route_kernel",
    "moe_count_kernel",
    "moe_schedule_kernel",
    "moe_scatter_kernel",
    "moe_combine_kernel",
];

/// The whole program: the sources concatenated, each preceded by a `#line` directive so
/// that NVRTC's messages name the real file and line.
pub fn program() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}
