//! Rotary position embedding (HF "rotate_half" convention), default and Llama-3 scaling.

/// Llama-3 style frequency scaling (`rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// cos/sin for positions `0..max_pos`, computed once in f64 and stored as f32, so every
/// backend uses the same table. Layout: `cos[pos * half + i]`, `sin[pos * half + i]`,
/// `half = rotary_dim / 2`.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub head_dim: usize,
    pub max_pos: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, max_pos: usize, theta: f64, scaling: Option<RopeScaling>) -> Self {
        let _ = (head_dim, max_pos, theta, scaling);
        unimplemented!("RopeTable::new")
    }

    /// Rotate `x` ([rows, n_heads * head_dim]) in place; row i is at position `positions[i]`.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, positions: &[usize]) {
        let _ = (x, n_heads, positions);
        unimplemented!("RopeTable::apply")
    }
}
