//! The BPE merges of a SentencePiece vocabulary, derived from its pieces and scores as
//! transformers' `SentencePieceExtractor` (`generate_merges`) derives them, so that the
//! rebuilt tokenizer is the one transformers' converter would write: every split of a piece
//! into two pieces of the vocabulary is a merge ranked by the piece's score (higher
//! first), ties by the longer left then right part, then in vocabulary order.

use std::collections::HashMap;

use serde_json::{json, Value};

/// The merges as `[left, right]` pairs (pieces may hold spaces).
pub fn merges(tokens: &[&str], scores: &[f32]) -> Value {
    let mut id: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    // Python's dict of (piece, score): a repeated piece keeps its last score but its first
    // place.
    let mut last_score: HashMap<&str, f32> = HashMap::with_capacity(tokens.len());
    for (i, (&t, &s)) in tokens.iter().zip(scores).enumerate() {
        id.entry(t).or_insert(i);
        last_score.insert(t, s);
    }
    // (score, chars of left, chars of right, left, right), in generation order.
    let mut all: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    let mut seen = std::collections::HashSet::with_capacity(tokens.len());
    for &piece in tokens {
        if !seen.insert(piece) {
            continue;
        }
        let score = last_score[piece];
        let mut local: Vec<(usize, usize, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(b, _)| {
                let (l, r) = piece.split_at(b);
                Some((*id.get(l)?, *id.get(r)?, l, r))
            })
            .collect();
        local.sort_by_key(|&(il, ir, _, _)| (il, ir));
        all.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (score, l.chars().count(), r.chars().count(), l, r)),
        );
    }
    // Python's sorted(reverse=True) on (score, len(left), len(right)): descending, stable.
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    Value::Array(
        all.into_iter()
            .map(|(_, _, _, l, r)| json!([l, r]))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_the_merged_pieces_scores() {
        let tokens = ["<unk>", "a", "b", "c", "ab", "abc", "bc"];
        let scores = [0.0, -1.0, -2.0, -3.0, -0.5, -0.1, -0.7];
        let m = merges(&tokens, &scores);
        // "abc" (-0.1) splits as a+bc and ab+c (vocabulary order of the left part: a, ab);
        // the longer left part first on a tie: ab+c before a+bc.
        assert_eq!(m, json!([["ab", "c"], ["a", "bc"], ["a", "b"], ["b", "c"]]));
    }
}
