//! The JSON form of `/update_weights_from_tensor` (docs/rl.md): SGLang's
//! `UpdateWeightsFromTensorReqInput` (sglang `python/sglang/srt/managers/io_struct.py`),
//! as slime and verl send it when the trainer and the rollout share the GPUs. Each element
//! of `serialized_named_tensors` is base64 of one TP rank's pickle (SGLang's
//! `MultiprocessingSerializer.serialize(obj, output_str=True)`) holding CUDA IPC handles
//! of the trainer's tensors; rank `i` reads element `i` (`arbor_model::batching::ipc`).
//! A body of another content type is a safetensors image (admin.rs).

use arbor_model::batching::ipc::{b64decode, parse_rank, IpcBuffer, IpcLayout};
use serde::Deserialize;
use serde_json::Value;

use super::api::ApiError;

/// Most ranks one call may name (one element each).
const MAX_RANKS: usize = 64;

/// The body (the query's `commit` says when it applies, as for a safetensors part).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FromTensorIpc {
    serialized_named_tensors: Value,
    load_format: Option<String>,
    pub weight_version: Option<String>,
    /// arbor's: what happens to the requests in flight (`wait`, `retract`, `abort`).
    pub policy: Option<String>,
    pub abort_all_requests: Option<bool>,
    /// Accepted for SGLang's clients: an update always drops the cached prefixes.
    #[allow(dead_code)]
    flush_cache: Option<bool>,
    /// Accepted for SGLang's clients: arbor serves no draft model.
    #[allow(dead_code)]
    disable_draft_model: Option<bool>,
    /// Accepted for SGLang's clients: the update gives memory back as it needs.
    #[allow(dead_code)]
    torch_empty_cache: Option<bool>,
}

/// Every rank's handles, read and checked here, so that a bad element is a 400 before
/// any rank opens a handle.
pub(super) fn ranks(r: &FromTensorIpc, tp: usize) -> Result<Vec<Vec<IpcBuffer>>, ApiError> {
    let layout = match r.load_format.as_deref() {
        None | Some("direct") => IpcLayout::Pairs,
        Some("flattened_bucket") => IpcLayout::FlattenedBucket,
        Some(other) => {
            return Err(ApiError::bad(
                "load_format",
                format!("load_format {other:?}: arbor reads CUDA IPC handles as null or \"direct\" (a list of (name, tensor) pairs) or \"flattened_bucket\" (SGLang's FlattenedTensorBucket)"),
            ))
        }
    };
    let Value::Array(items) = &r.serialized_named_tensors else {
        return Err(ApiError::bad(
            "serialized_named_tensors",
            "serialized_named_tensors is a list of base64 strings, one per TP rank",
        ));
    };
    if items.len() != tp || items.len() > MAX_RANKS {
        return Err(ApiError::bad(
            "serialized_named_tensors",
            format!(
                "serialized_named_tensors has {} elements, and this server runs {tp} TP ranks: give one per rank (rank i reads element i)",
                items.len()
            ),
        ));
    }
    let mut ranks = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = format!("serialized_named_tensors[{i}]");
        let Value::String(text) = item else {
            return Err(ApiError::bad(
                field.clone(),
                format!("{field} is not a string (base64 of the rank's pickle)"),
            ));
        };
        let bytes = b64decode(text)
            .map_err(|e| ApiError::bad(field.clone(), format!("{field}: not base64: {e}")))?;
        let bufs = parse_rank(&bytes, layout)
            .map_err(|e| ApiError::bad(field.clone(), format!("{field}: {e}")))?;
        ranks.push(bufs);
    }
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_field() {
        let e = |body: &str| {
            let r: FromTensorIpc = serde_json::from_str(body).expect("a body");
            match ranks(&r, 2) {
                Err(e) => (e.param.map(|p| p.to_string()), e.message),
                Ok(_) => panic!("{body} accepted"),
            }
        };
        let (p, m) = e(r#"{"serialized_named_tensors": ["AAAA"]}"#);
        assert_eq!(p.as_deref(), Some("serialized_named_tensors"));
        assert!(m.contains("1 elements") && m.contains("2 TP ranks"), "{m}");
        let (p, m) = e(r#"{"serialized_named_tensors": ["gAROLg==", 3]}"#);
        assert_eq!(p.as_deref(), Some("serialized_named_tensors[0]"));
        assert!(
            m.contains("a list of (name, tensor) pairs, got None"),
            "{m}"
        );
        let (p, m) = e(r#"{"serialized_named_tensors": ["AAAA", "AAAA"], "load_format": "x"}"#);
        assert_eq!(p.as_deref(), Some("load_format"));
        assert!(m.contains("\"x\""), "{m}");
        let (p, m) = e(r#"{"serialized_named_tensors": ["A", "A"]}"#);
        assert_eq!(p.as_deref(), Some("serialized_named_tensors[0]"));
        assert!(m.contains("not base64"), "{m}");
    }
}
