//! CPU reference backend: bf16 storage, f32 accumulation, fixed reduction orders.
//!
//! Every function computes each output row with the same sequence of operations whatever
//! the number of rows, the row's position in the batch, or the number of threads.
//! Size mismatches between arguments are programming errors of the caller and panic with
//! a message naming the sizes; data values never panic.

pub mod attention;
pub mod digest;
pub mod elementwise;
pub mod gumbel;
pub mod leaf;
pub mod matmul;
pub mod norm;
pub mod rope;
pub mod softmax;
pub mod threads;

#[cfg(test)]
mod testutil;

pub use attention::{attention, attention_on, AttnShape, PagedKv, ATTN_BLOCK};
pub use digest::{digest, DIGEST_CHUNK, DIGEST_GROUP};
pub use elementwise::{add_assign, add_row_bias, embedding, silu_mul};
pub use gumbel::{gumbel_argmax, tempered_sum, GumbelDraw, MaskedDraw, RowDraw};
pub use leaf::{bf16_to_f32, LANES};
pub use matmul::{
    plain_matmul, plain_matmul_on, tree_matmul, tree_matmul_on, tree_matmul_unfused_on, TreeMatmul,
};
pub use norm::rms_norm;
pub use rope::{yarn_mscale, Llama3Scaling, RopeError, RopeScaling, RopeTable, YarnScaling};
pub use softmax::{argmax, log_softmax_at, softmax, RowStats};
pub use threads::{num_threads, set_num_threads, THREADS_ENV};
