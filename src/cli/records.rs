//! The JSONL records `generate` and `score` read and write.
//!
//! Log-probs are written as JSON numbers (the shortest text that reads back as the same
//! f32); NaN and ±inf, which JSON cannot hold, are written as the strings "NaN", "inf" and
//! "-inf" so a broken run still produces a readable file. Logits digests are 16-digit hex
//! strings: JSON readers that use doubles would corrupt a u64.

use serde::{Deserialize, Serialize};

use super::model_api::TokenLogprob;

/// One line of a `--prompts` file: text or token ids, with an optional id.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptLine {
    pub id: Option<u64>,
    pub prompt: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

/// One alternative at a generated position.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TopEntry {
    pub token: u32,
    #[serde(with = "f32_json")]
    pub logprob: f32,
}

impl TopEntry {
    /// A record's `top` field from the runner's alternatives: absent unless `n_top > 0`.
    pub fn table(n_top: usize, top: Vec<Vec<TokenLogprob>>) -> Option<Vec<Vec<TopEntry>>> {
        (n_top > 0).then(|| {
            top.into_iter()
                .map(|alts| {
                    alts.into_iter()
                        .map(|a| TopEntry {
                            token: a.token,
                            logprob: a.logprob,
                        })
                        .collect()
                })
                .collect()
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    Length,
    Eos,
}

/// One line of `generate`'s JSONL output.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenRecord {
    pub id: u64,
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(with = "f32_vec_json")]
    pub logprobs: Vec<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top: Option<Vec<Vec<TopEntry>>>,
    #[serde(with = "digest_json")]
    pub logits_digest: Vec<u64>,
    pub finish: Finish,
}

/// One line of `score`'s input: either `{"id","tokens","prompt_len"}` or a `generate`
/// record (then the sequence is `prompt_tokens ++ tokens` and the prompt length is
/// `prompt_tokens.len()`). Other fields of a generate record are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct ScoreLine {
    pub id: Option<u64>,
    pub tokens: Vec<u32>,
    pub prompt_len: Option<usize>,
    pub prompt_tokens: Option<Vec<u32>>,
}

impl ScoreLine {
    /// The full sequence and its prompt length; `line` names the input line in errors.
    pub fn sequence(self, line: usize) -> Result<(Option<u64>, Vec<u32>, usize), String> {
        match (self.prompt_tokens, self.prompt_len) {
            (Some(_), Some(_)) => Err(format!(
                "line {line}: give either \"prompt_tokens\" (a generate record) or \"prompt_len\", not both"
            )),
            (Some(mut prompt), None) => {
                let prompt_len = prompt.len();
                prompt.extend_from_slice(&self.tokens);
                Ok((self.id, prompt, prompt_len))
            }
            (None, Some(prompt_len)) => {
                if prompt_len == 0 || prompt_len > self.tokens.len() {
                    return Err(format!(
                        "line {line}: prompt_len {prompt_len} must be in 1..={} (the number of tokens)",
                        self.tokens.len()
                    ));
                }
                Ok((self.id, self.tokens, prompt_len))
            }
            (None, None) => Err(format!(
                "line {line}: needs \"prompt_len\" (or \"prompt_tokens\" as in generate's output)"
            )),
        }
    }
}

/// One line of `score`'s output: log-probs of `tokens[prompt_len..]`, each given its prefix.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScoreRecord {
    pub id: u64,
    pub prompt_len: usize,
    pub tokens: Vec<u32>,
    #[serde(with = "f32_vec_json")]
    pub logprobs: Vec<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top: Option<Vec<Vec<TopEntry>>>,
    #[serde(with = "digest_json")]
    pub logits_digest: Vec<u64>,
}

/// An f32 as a JSON number, or "NaN" / "inf" / "-inf".
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum JsonF32 {
    Num(f32),
    Text(String),
}

impl JsonF32 {
    fn from_f32(v: f32) -> Self {
        if v.is_finite() {
            JsonF32::Num(v)
        } else if v.is_nan() {
            JsonF32::Text("NaN".into())
        } else if v > 0.0 {
            JsonF32::Text("inf".into())
        } else {
            JsonF32::Text("-inf".into())
        }
    }

    fn into_f32<E: serde::de::Error>(self) -> Result<f32, E> {
        match self {
            JsonF32::Num(v) => Ok(v),
            JsonF32::Text(t) => match t.as_str() {
                "NaN" => Ok(f32::NAN),
                "inf" => Ok(f32::INFINITY),
                "-inf" => Ok(f32::NEG_INFINITY),
                other => Err(E::custom(format!(
                    "expected a number, \"NaN\", \"inf\" or \"-inf\", found {other:?}"
                ))),
            },
        }
    }
}

mod f32_json {
    use super::JsonF32;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        JsonF32::from_f32(*v).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        JsonF32::deserialize(d)?.into_f32()
    }
}

mod f32_vec_json {
    use super::JsonF32;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|x| JsonF32::from_f32(*x)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        Vec::<JsonF32>::deserialize(d)?
            .into_iter()
            .map(JsonF32::into_f32)
            .collect()
    }
}

mod digest_json {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u64], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|x| format!("{x:016x}")))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|h| {
                u64::from_str_radix(h, 16)
                    .map_err(|e| D::Error::custom(format!("logits digest {h:?} is not hex: {e}")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(logprobs: Vec<f32>) -> GenRecord {
        GenRecord {
            id: 7,
            prompt_tokens: vec![1, 2],
            tokens: vec![3, 4, 5],
            text: Some("abc".into()),
            logprobs,
            top: Some(vec![vec![TopEntry {
                token: 3,
                logprob: -0.25,
            }]]),
            logits_digest: vec![u64::MAX, 0, 0x0123_4567_89ab_cdef],
            finish: Finish::Length,
        }
    }

    #[test]
    fn gen_record_round_trips_bits() {
        let odd = [
            -1.0e-30f32,
            -std::f32::consts::PI,
            f32::from_bits(0x8000_0001),
            -0.0,
            -87.33654,
            f32::NEG_INFINITY,
        ];
        let r = record(odd.to_vec());
        let line = serde_json::to_string(&r).unwrap();
        let back: GenRecord = serde_json::from_str(&line).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.logprobs), bits(&odd));
        assert_eq!(back.logits_digest, r.logits_digest);
        assert!(line.contains("\"ffffffffffffffff\""), "{line}");
        assert!(line.contains("\"finish\":\"length\""), "{line}");
        let nan = record(vec![f32::NAN]);
        let back: GenRecord = serde_json::from_str(&serde_json::to_string(&nan).unwrap()).unwrap();
        assert!(back.logprobs[0].is_nan());
    }

    #[test]
    fn score_reads_a_generate_record() {
        let line = serde_json::to_string(&record(vec![-1.0, -2.0, -3.0])).unwrap();
        let s: ScoreLine = serde_json::from_str(&line).unwrap();
        let (id, seq, prompt_len) = s.sequence(1).unwrap();
        assert_eq!((id, seq, prompt_len), (Some(7), vec![1, 2, 3, 4, 5], 2));
    }

    #[test]
    fn score_line_rejects_bad_prompt_len() {
        let s: ScoreLine = serde_json::from_str(r#"{"tokens":[1,2],"prompt_len":3}"#).unwrap();
        let e = s.sequence(4).unwrap_err();
        assert!(e.contains("line 4") && e.contains("prompt_len 3"), "{e}");
        let s: ScoreLine = serde_json::from_str(r#"{"tokens":[1,2]}"#).unwrap();
        assert!(s.sequence(1).unwrap_err().contains("prompt_len"));
    }

    #[test]
    fn bad_digest_is_named() {
        let mut v = serde_json::to_value(record(vec![-1.0])).unwrap();
        v["logits_digest"] = serde_json::json!(["xyz"]);
        let e = serde_json::from_value::<GenRecord>(v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"xyz\""), "{e}");
    }
}
