//! Weights pushed in many calls without saying which is the last (TP 2): SGLang's clients
//! send a checkpoint as buckets (slime, AReaL) or tensor by tensor (OpenRLHF, TRL), and
//! each call applies as it arrives there. arbor stages them and swaps once every tensor
//! the model reads has arrived: until then the old weights serve, bit for bit; after, the
//! bits are a fresh server's on the new weights (what a one-shot push gives).

use serde_json::{json, Value};

use crate::bits::assert_serves;
use crate::checkpoint::{models, Tensors};
use crate::server::Server;

#[test]
fn buckets_and_single_tensors_apply_once_every_tensor_has_arrived() {
    let m = models();
    let s = Server::start(2, &m.a, &[], "buckets");
    let total = m.c_tensors.names().len();
    // C in 4 buckets, each naming the version (slime sends it with every bucket).
    let parts = m.c_tensors.parts(4);
    assert_eq!(parts.len(), 4);
    for (i, p) in parts.iter().enumerate() {
        let (st, v) = s.push("weight_version=C", p);
        assert_eq!(st, 200, "bucket {i}: {v}");
        if i + 1 < parts.len() {
            assert_eq!(v["model_tensors"], json!(total), "{v}");
            assert!(
                v["staged_tensors"].as_u64().expect("staged") < total as u64,
                "{v}"
            );
            assert_eq!(v.get("weight_version"), None, "not applied yet: {v}");
            // The old weights serve meanwhile, unchanged.
            assert_serves(&s, "0");
        } else {
            assert_eq!(
                v["weight_version"],
                json!("C"),
                "the last bucket applies: {v}"
            );
        }
    }
    assert_serves(&s, "C");

    // Back to A one tensor per call, as per-tensor clients push; continue_generation in
    // the middle says the push is incomplete and changes nothing.
    let a = Tensors::read(&m.a.join("model.safetensors"));
    let names = a.names();
    for (i, n) in names.iter().enumerate() {
        if i == names.len() / 2 {
            let v = s.ok("/continue_generation", &json!({}));
            assert_eq!(v["staged_tensors"], json!(i), "{v}");
            assert_serves(&s, "C");
        }
        let (st, v) = s.push("weight_version=A", &a.image(&[*n]));
        assert_eq!(st, 200, "{n}: {v}");
        let applied = v.get("weight_version").and_then(Value::as_str);
        assert_eq!(applied, (i + 1 == names.len()).then_some("A"), "{n}: {v}");
    }
    assert_serves(&s, "A");

    // An explicit commit of an incomplete push is still refused, naming what is missing,
    // and drops what was staged.
    let (st, v) = s.push(
        "commit=false",
        &m.c_tensors.image(&m.c_tensors.names()[1..]),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.push("commit=true", &[]);
    assert_eq!(st, 400, "{v}");
    let first = m.c_tensors.names()[0].clone();
    assert!(
        v["message"].as_str().expect("message").contains(&first),
        "{v}"
    );
    assert_serves(&s, "A");
}
