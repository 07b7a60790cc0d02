/// In-place softmax over one row, fixed order.
pub fn softmax(row: &mut [f32]) {
    let _ = row;
    unimplemented!("softmax")
}

/// log_softmax(row)[idx], fixed order (max, then sum of exp in index order).
pub fn log_softmax_at(row: &[f32], idx: usize) -> f32 {
    let _ = (row, idx);
    unimplemented!("log_softmax_at")
}

/// Index of the largest value; the lowest index wins ties. NaN never wins.
pub fn argmax(row: &[f32]) -> usize {
    let _ = row;
    unimplemented!("argmax")
}
