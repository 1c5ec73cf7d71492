//! Top-k reference: sort every selectable visible entry by (logit desc, index asc), keep k.

/// Top-k of one row (k = `k`), −1 padded; see the module docs for the rules.
pub fn select(logits: &[f32], visible: usize, k: usize) -> Vec<i32> {
    let visible = visible.min(logits.len());
    let mut out: Vec<i32> = if visible <= k {
        (0..visible as i32).collect()
    } else {
        let mut c: Vec<i32> = (0..visible as i32)
            .filter(|&j| logits[j as usize] > f32::NEG_INFINITY)
            .collect();
        c.sort_by(|&a, &b| super::order(logits[a as usize], a, logits[b as usize], b));
        c.truncate(k);
        c
    };
    out.resize(k, -1);
    out
}

/// Scored selection over `values` (no "all visible" shortcut), sorted, −1 padded to `k`.
pub fn select_scored(values: &[f32], k: usize) -> Vec<i32> {
    let mut c: Vec<i32> = (0..values.len() as i32)
        .filter(|&j| values[j as usize] > f32::NEG_INFINITY)
        .collect();
    c.sort_by(|&a, &b| super::order(values[a as usize], a, values[b as usize], b));
    c.truncate(k);
    c.resize(k, -1);
    c
}

/// Top-k of every row of `keys` (rows, n_cols) over its first `n_valid[t]` keys (clamped to
/// `0..=n_cols`) with [`select`]: the module's order contract, −1 padded, (rows, k). This is what
/// the CUDA kernel returns (`kernels/topk.cu` sorts its selection into this order).
pub fn select_rows(keys: &[f32], n_cols: usize, n_valid: &[i32], k: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(n_valid.len() * k);
    for (t, &nv) in n_valid.iter().enumerate() {
        let row = &keys[t * n_cols..(t + 1) * n_cols];
        out.extend(select(row, (nv.max(0) as usize).min(n_cols), k));
    }
    out
}
