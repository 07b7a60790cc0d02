//! The bytes of every token of the served tokenizer, for llguidance's token trie: a
//! byte-level BPE's characters mapped back to bytes (GPT-2's table), a SentencePiece
//! vocabulary's `▁` as a space and `<0xNN>` as its byte, special tokens behind llguidance's
//! marker byte (so that no text grammar produces them), and ids past the tokenizer (a model
//! vocabulary padded beyond it) as special tokens nobody can write.

use std::collections::HashMap;

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// How the tokenizer spells bytes in its vocabulary.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Spelling {
    /// GPT-2's byte-to-character table (`ByteLevel` decoder).
    ByteLevel,
    /// SentencePiece: `space` stands for ' ', `<0xNN>` for a byte (`ByteFallback`,
    /// `Metaspace` or a `Replace` of it by ' ').
    Pieces { space: char },
}

/// The decoder's JSON (serde's form of the tokenizer's decoder) tells the spelling.
fn spelling(decoder: &serde_json::Value) -> Option<Spelling> {
    fn walk(d: &serde_json::Value, level: &mut bool, pieces: &mut bool, space: &mut char) {
        match d["type"].as_str() {
            Some("ByteLevel") => *level = true,
            Some("ByteFallback") => *pieces = true,
            Some("Metaspace") => {
                *pieces = true;
                if let Some(c) = d["replacement"].as_str().and_then(|s| s.chars().next()) {
                    *space = c;
                }
            }
            Some("Replace") if d["content"].as_str() == Some(" ") => {
                let mut chars = d["pattern"]["String"].as_str().unwrap_or("").chars();
                if let (Some(c), None) = (chars.next(), chars.next()) {
                    *space = c;
                    *pieces = true;
                }
            }
            Some("Sequence") => {
                for d in d["decoders"].as_array().into_iter().flatten() {
                    walk(d, level, pieces, space);
                }
            }
            _ => {}
        }
    }
    let (mut level, mut pieces, mut space) = (false, false, '\u{2581}');
    walk(decoder, &mut level, &mut pieces, &mut space);
    if level {
        Some(Spelling::ByteLevel)
    } else if pieces {
        Some(Spelling::Pieces { space })
    } else {
        None
    }
}

/// GPT-2's table: the printable bytes stand for themselves, the others for U+0100 on.
fn byte_level_table() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for b in 0..=255u8 {
        if printable(b) {
            map.insert(b as char, b);
        } else {
            if let Some(c) = char::from_u32(next) {
                map.insert(c, b);
            }
            next += 1;
        }
    }
    map
}

/// A special token's spelling in the trie: the marker byte, then its name.
fn special(name: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(name.len() + 1);
    b.push(TokTrie::SPECIAL_TOKEN_MARKER);
    b.extend_from_slice(name.as_bytes());
    b
}

/// The bytes of ids `0..vocab`; an error names a tokenizer whose spelling is unknown.
pub fn token_bytes(tok: &tokenizers::Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>, String> {
    let decoder = tok
        .get_decoder()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| format!("cannot read the tokenizer's decoder: {e}"))?
        .unwrap_or(serde_json::Value::Null);
    let spelling = spelling(&decoder).ok_or_else(|| {
        format!(
            "structured output needs a byte-level BPE or SentencePiece tokenizer; this one's decoder is {}",
            decoder["type"].as_str().unwrap_or("missing")
        )
    })?;
    let table = byte_level_table();
    let added = tok.get_added_tokens_decoder();
    let mut out = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        let bytes = match (added.get(&id), tok.id_to_token(id)) {
            (Some(a), _) if a.special => special(&a.content),
            (Some(a), _) => a.content.as_bytes().to_vec(),
            (None, None) => special(&format!("<[{id}]>")),
            (None, Some(name)) => match spelling {
                Spelling::ByteLevel => {
                    // A name outside the table cannot be spelt: nobody may write it.
                    let b: Option<Vec<u8>> = name.chars().map(|c| table.get(&c).copied()).collect();
                    b.unwrap_or_else(|| special(&name))
                }
                Spelling::Pieces { space } => match byte_piece(&name) {
                    Some(b) => vec![b],
                    None => name.replace(space, " ").into_bytes(),
                },
            },
        };
        out.push(bytes);
    }
    Ok(out)
}

/// `<0xNN>`'s byte.
fn byte_piece(name: &str) -> Option<u8> {
    let hex = name.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

/// The tokenizer as llguidance sees it: the trie of its tokens' bytes, and its own
/// encoding for text the grammar forces.
pub struct Env {
    trie: TokTrie,
    tok: tokenizers::Tokenizer,
}

impl Env {
    /// The trie over ids `0..vocab`, ending on any of `eos` (at least one, each in the
    /// vocabulary).
    pub fn new(tok: tokenizers::Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self, String> {
        let first = *eos
            .first()
            .ok_or("structured output needs an end-of-sequence token; the model names none")?;
        if let Some(e) = eos.iter().find(|&&e| e as usize >= vocab) {
            return Err(format!(
                "end-of-sequence token {e} is outside the vocabulary of {vocab}"
            ));
        }
        let words = token_bytes(&tok, vocab)?;
        let info = TokRxInfo::new(vocab as u32, first);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        Ok(Env { trie, tok })
    }
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tok
                .encode(s, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn spellings_of_the_decoders_arbor_meets() {
        assert_eq!(
            spelling(&json!({"type": "ByteLevel"})),
            Some(Spelling::ByteLevel)
        );
        let sp = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
        assert_eq!(spelling(&sp), Some(Spelling::Pieces { space: '\u{2581}' }));
        assert_eq!(spelling(&json!({"type": "WordPiece"})), None);
        assert_eq!(byte_piece("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_piece("<0x0>"), None);
        assert_eq!(byte_piece("hello"), None);
    }

    #[test]
    fn the_byte_level_table_is_a_bijection() {
        let t = byte_level_table();
        assert_eq!(t.len(), 256);
        let mut bytes: Vec<u8> = t.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
        assert_eq!(t[&'\u{120}'], b' ');
        assert_eq!(t[&'A'], b'A');
    }
}
