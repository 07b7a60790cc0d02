//! Element-wise kernels: each output element depends on its own inputs only.
use half::bf16;

use super::leaf::bf16_to_f32;

/// out[i] = silu(gate[i]) * up[i], with silu(g) = g / (1 + exp(-g)) (= g·sigmoid(g)).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "silu_mul: gate has {} values, up has {}",
        gate.len(),
        up.len()
    );
    assert_eq!(
        out.len(),
        gate.len(),
        "silu_mul: out has {} values, gate has {}",
        out.len(),
        gate.len()
    );
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (g / (1.0 + (-g).exp())) * u;
    }
}

/// x[r, c] += bias[c].
pub fn add_row_bias(x: &mut [f32], bias: &[f32]) {
    if bias.is_empty() {
        assert!(
            x.is_empty(),
            "add_row_bias: empty bias for {} values",
            x.len()
        );
        return;
    }
    assert_eq!(
        x.len() % bias.len(),
        0,
        "add_row_bias: {} values are not rows of {}",
        x.len(),
        bias.len()
    );
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// x += y.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    assert_eq!(
        x.len(),
        y.len(),
        "add_assign: x has {} values, y has {}",
        x.len(),
        y.len()
    );
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Rows `ids` of `table` ([vocab, cols] bf16) as f32 into out ([ids.len(), cols]).
/// An id out of range is the caller's error to report; here it panics with the id.
pub fn embedding(table: &[bf16], cols: usize, ids: &[u32], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        ids.len() * cols,
        "embedding: out has {} values for {} ids × {cols}",
        out.len(),
        ids.len()
    );
    if cols == 0 {
        return;
    }
    assert_eq!(
        table.len() % cols,
        0,
        "embedding: table of {} values is not rows of {cols}",
        table.len()
    );
    let vocab = table.len() / cols;
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(cols)) {
        let id = id as usize;
        assert!(
            id < vocab,
            "embedding: token id {id} out of range for a vocabulary of {vocab}"
        );
        for (d, &s) in o.iter_mut().zip(&table[id * cols..(id + 1) * cols]) {
            *d = bf16_to_f32(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_matches_f64() {
        let g = [-100.0f32, -3.0, -0.5, 0.0, 0.25, 2.0, 30.0, 100.0];
        let u = [1.5f32, -2.0, 3.0, 4.0, -1.0, 0.5, 2.0, -1.0];
        let mut out = [0.0; 8];
        silu_mul(&g, &u, &mut out);
        for i in 0..8 {
            let gd = g[i] as f64;
            let want = gd / (1.0 + (-gd).exp()) * u[i] as f64;
            assert!(
                (out[i] as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
                "{i}: {} vs {want}",
                out[i]
            );
        }
    }

    #[test]
    fn bias_and_add() {
        let mut x = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        add_row_bias(&mut x, &[10.0, 20.0, 30.0]);
        assert_eq!(x, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        add_assign(&mut x, &[1.0; 6]);
        assert_eq!(x, [12.0, 23.0, 34.0, 15.0, 26.0, 37.0]);
    }

    #[test]
    fn embedding_looks_up_rows_exactly() {
        let table: Vec<bf16> = (0..12)
            .map(|i| bf16::from_f32(i as f32 * 0.5 - 2.0))
            .collect();
        let mut out = vec![0.0; 9];
        embedding(&table, 3, &[3, 0, 3], &mut out);
        assert_eq!(out, [2.5, 3.0, 3.5, -2.0, -1.5, -1.0, 2.5, 3.0, 3.5]);
    }

    #[test]
    #[should_panic(expected = "token id 4 out of range for a vocabulary of 4")]
    fn embedding_names_a_bad_id() {
        let mut out = vec![0.0; 3];
        embedding(&[bf16::ZERO; 12], 3, &[4], &mut out);
    }
}
