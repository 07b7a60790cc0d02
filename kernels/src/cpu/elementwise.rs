use half::bf16;

/// out[i] = silu(gate[i]) * up[i].
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let _ = (gate, up, out);
    unimplemented!("silu_mul")
}

/// x[r, c] += bias[c].
pub fn add_row_bias(x: &mut [f32], bias: &[f32]) {
    let _ = (x, bias);
    unimplemented!("add_row_bias")
}

/// x += y.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    let _ = (x, y);
    unimplemented!("add_assign")
}

/// Rows `ids` of `table` ([vocab, cols] bf16) as f32 into out ([ids.len(), cols]).
/// An id out of range is the caller's error to report; here it panics with the id.
pub fn embedding(table: &[bf16], cols: usize, ids: &[u32], out: &mut [f32]) {
    let _ = (table, cols, ids, out);
    unimplemented!("embedding")
}
