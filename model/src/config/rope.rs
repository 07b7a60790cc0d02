//! RoPE settings from either config generation: transformers 4 (`rope_theta` +
//! `rope_scaling`) and transformers 5 (`rope_parameters`, flat or keyed by layer type).
//! Both land in the same `(theta, schedule)`, so twins give the same bits.

use std::path::Path;

use arbor_kernels::cpu::{yarn_mscale, Llama3Scaling, RopeScaling, YarnScaling};
use serde_json::{Map, Value};

use super::cfg_err;
use crate::error::MResult;

/// HF's `default_theta` for Llama, Mistral and Qwen3 alike.
const DEFAULT_THETA: f64 = 10000.0;

/// Keys every RoPE dict may hold, whatever its type.
const COMMON: &[&str] = &["rope_type", "type", "rope_theta", "partial_rotary_factor"];

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

/// Reads the RoPE settings of `obj`; `layer_types` are the config's layer types (used to
/// recognise the per-layer-type form) and `max_pos` its `max_position_embeddings`.
pub fn parse(
    obj: &Map<String, Value>,
    path: &Path,
    layer_types: &[String],
    max_pos: usize,
) -> MResult<Rope> {
    let top_theta = number(obj.get("rope_theta"), "rope_theta", path)?;
    check_partial(
        obj.get("partial_rotary_factor"),
        "partial_rotary_factor",
        path,
    )?;
    let legacy = object_or_null(obj.get("rope_scaling"), "rope_scaling", path)?;
    let params = match object_or_null(obj.get("rope_parameters"), "rope_parameters", path)? {
        Some(p) => Some(flatten_per_layer(p, layer_types, path)?),
        None => None,
    };
    let from_params = params.map(|p| one(p, "rope_parameters", top_theta, max_pos, path));
    let from_legacy = legacy.map(|l| one(l, "rope_scaling", top_theta, max_pos, path));
    match (from_params, from_legacy) {
        (Some(p), Some(l)) => {
            let (p, l) = (p?, l?);
            if p != l {
                return Err(cfg_err(
                    path,
                    format!("\"rope_parameters\" ({p:?}) and \"rope_scaling\" ({l:?}) disagree; keep one of them"),
                ));
            }
            Ok(p)
        }
        (Some(r), None) | (None, Some(r)) => r,
        (None, None) => Ok(Rope {
            theta: theta_or_default(top_theta, path),
            scaling: None,
        }),
    }
}

fn theta_or_default(theta: Option<f64>, path: &Path) -> f64 {
    theta.unwrap_or_else(|| {
        tracing::warn!(
            config = %path.display(),
            "no rope_theta: using transformers' default {DEFAULT_THETA}"
        );
        DEFAULT_THETA
    })
}

/// The per-layer-type form (`{"full_attention": {...}, "sliding_attention": {...}}`) is
/// accepted when every layer type the model uses has the same settings; arbor has one table.
fn flatten_per_layer<'a>(
    p: &'a Map<String, Value>,
    layer_types: &[String],
    path: &Path,
) -> MResult<&'a Map<String, Value>> {
    let is_layer_key = |k: &str| {
        layer_types.iter().any(|t| t == k) || k == "full_attention" || k == "sliding_attention"
    };
    if !p.keys().any(|k| is_layer_key(k)) {
        return Ok(p);
    }
    if let Some(k) = p.keys().find(|k| !is_layer_key(k)) {
        return Err(cfg_err(
            path,
            format!("\"rope_parameters\" mixes per-layer-type entries with the key \"{k}\""),
        ));
    }
    let mut first: Option<(&String, &'a Map<String, Value>)> = None;
    for t in layer_types {
        let Some(v) = p.get(t) else {
            return Err(cfg_err(
                path,
                format!("\"rope_parameters\" has no entry for layer type \"{t}\""),
            ));
        };
        let Value::Object(m) = v else {
            return Err(cfg_err(
                path,
                format!("\"rope_parameters\".\"{t}\" must be an object, got {v}"),
            ));
        };
        match first {
            None => first = Some((t, m)),
            Some((t0, m0)) if m0 != m => {
                return Err(cfg_err(
                    path,
                    format!("\"rope_parameters\" differs between layer types \"{t0}\" and \"{t}\"; arbor supports one RoPE for all layers"),
                ))
            }
            Some(_) => {}
        }
    }
    first.map(|(_, m)| m).ok_or_else(|| {
        cfg_err(
            path,
            "\"rope_parameters\" is keyed by layer type but \"layer_types\" is empty".into(),
        )
    })
}

/// One RoPE dict (`rope_scaling` or a flat `rope_parameters`) named `what` in errors.
fn one(
    d: &Map<String, Value>,
    what: &str,
    top_theta: Option<f64>,
    max_pos: usize,
    path: &Path,
) -> MResult<Rope> {
    let err = |msg: String| cfg_err(path, format!("\"{what}\": {msg}"));
    let kind = match d.get("rope_type").or_else(|| d.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(err(format!("rope_type must be a string, got {v}"))),
    };
    let theta = match (number(d.get("rope_theta"), "rope_theta", path)?, top_theta) {
        (Some(a), Some(b)) if a != b => {
            return Err(err(format!(
                "rope_theta {a} disagrees with the top-level rope_theta {b}"
            )))
        }
        (Some(a), _) => a,
        (None, b) => theta_or_default(b, path),
    };
    check_partial(
        d.get("partial_rotary_factor"),
        "partial_rotary_factor",
        path,
    )?;
    let extra: &[&str] = match kind {
        "default" => &[],
        "linear" => &["factor"],
        "dynamic" => &["factor", "original_max_position_embeddings"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        other => {
            return Err(err(format!(
                "rope_type {other:?} is not supported (arbor implements default, linear, dynamic, llama3 and yarn)"
            )))
        }
    };
    if let Some(k) = d
        .keys()
        .find(|k| !COMMON.contains(&k.as_str()) && !extra.contains(&k.as_str()))
    {
        return Err(err(format!(
            "key \"{k}\" is not understood for rope_type {kind:?}; refusing rather than ignoring it"
        )));
    }
    let num = |k: &str| number(d.get(k), k, path);
    let req = |k: &str| -> MResult<f64> {
        num(k)?.ok_or_else(|| err(format!("rope_type {kind:?} needs \"{k}\"")))
    };
    let original = || -> MResult<usize> {
        match d.get("original_max_position_embeddings") {
            None | Some(Value::Null) => Ok(max_pos),
            Some(v) => {
                let n = v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        err(format!(
                            "original_max_position_embeddings must be a positive integer, got {v}"
                        ))
                    })?;
                super::check_positions("original_max_position_embeddings", n, path)?;
                Ok(n)
            }
        }
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: req("factor")?,
        }),
        "dynamic" => Some(RopeScaling::Dynamic {
            factor: req("factor")?,
            original_max_position_embeddings: original()?,
        }),
        "llama3" => Some(RopeScaling::Llama3(Llama3Scaling {
            factor: req("factor")?,
            low_freq_factor: req("low_freq_factor")?,
            high_freq_factor: req("high_freq_factor")?,
            original_max_position_embeddings: original()?,
        })),
        _ => {
            let original = original()?;
            // HF: a null factor means the ratio of the two contexts.
            let factor = num("factor")?.unwrap_or(max_pos as f64 / original as f64);
            // HF reads these with `or`, so 0 and null both mean the default.
            let or = |k: &str, dflt: f64| -> MResult<f64> {
                Ok(num(k)?.filter(|&x| x != 0.0).unwrap_or(dflt))
            };
            let attention_factor = match num("attention_factor")? {
                Some(a) => a,
                None => match (num("mscale")?, num("mscale_all_dim")?) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, a)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            let truncate = match d.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(err(format!("truncate must be true or false, got {v}"))),
            };
            Some(RopeScaling::Yarn(YarnScaling {
                factor,
                original_max_position_embeddings: original,
                beta_fast: or("beta_fast", 32.0)?,
                beta_slow: or("beta_slow", 1.0)?,
                truncate,
                attention_factor,
            }))
        }
    };
    Ok(Rope { theta, scaling })
}

fn number(v: Option<&Value>, key: &str, path: &Path) -> MResult<Option<f64>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| cfg_err(path, format!("\"{key}\" must be a number, got {v}"))),
    }
}

fn object_or_null<'a>(
    v: Option<&'a Value>,
    key: &str,
    path: &Path,
) -> MResult<Option<&'a Map<String, Value>>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(other) => Err(cfg_err(
            path,
            format!("\"{key}\" must be an object or null, got {other}"),
        )),
    }
}

/// Partial rotary embedding rotates only part of each head; none of the supported
/// families uses it, so anything but 1 is refused.
fn check_partial(v: Option<&Value>, key: &str, path: &Path) -> MResult<()> {
    match number(v, key, path)? {
        None | Some(1.0) => Ok(()),
        Some(f) => Err(cfg_err(
            path,
            format!("\"{key}\" {f} is not supported (arbor rotates the whole head)"),
        )),
    }
}
