//! Chat templates from a GGUF file: one written with macros (as tool-calling templates
//! are) serves chat; one that cannot be parsed turns chat off, naming where it came from,
//! while completions keep working. Either once stopped `arbor serve` from starting.

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::cli_support::*;
use crate::gguf_testfile::{strv, Builder};
use crate::server::Server;

/// `arbor serve` at TP 1 on the test GGUF model with `template` as its chat template.
fn serve_gguf(scratch: &Scratch, tag: &str, template: &str) -> (Server, PathBuf) {
    let path = scratch.path().join(format!("{tag}.gguf"));
    let b = Builder::llama().set("tokenizer.chat_template", strv(template));
    std::fs::write(&path, b.bytes()).expect("write GGUF");
    let log = scratch.path().join(format!("{tag}.log"));
    // The test model's context is 64 positions.
    (Server::start_on(&path, 1, &[], 64, &[], log), path)
}

fn chat(s: &Server) -> (u16, Value) {
    s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.0}),
    )
}

#[test]
fn macro_templates_serve_and_unparsable_ones_turn_only_chat_off() {
    let scratch = Scratch::new("serve-templates");
    let macros = "{%- macro turn(role, text) -%}<|{{ role }}|>{{ text | trim }}{%- endmacro -%}\
        {%- for m in messages %}{{ turn(m.role, m.content) }}{% endfor -%}\
        {%- if add_generation_prompt %}{{ turn('assistant', '') }}{% endif %}";
    let (s, _) = serve_gguf(&scratch, "macros", macros);
    let (st, v) = chat(&s);
    assert_eq!(st, 200, "{v}\n{}", s.log_text());
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    drop(s);

    let (s, path) = serve_gguf(&scratch, "broken", "{% frobnicate %}{{ messages }}");
    let (st, v) = chat(&s);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "chat_unavailable", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    for needle in [
        "chat is unavailable",
        &format!("{} (tokenizer.chat_template)", path.display()),
        "frobnicate",
    ] {
        assert!(msg.contains(needle), "{needle:?} not in {msg}");
    }
    assert!(
        s.log_text().contains("chat is off"),
        "the server says so when it starts:\n{}",
        s.log_text()
    );
    let v = s.completion(&json!({"prompt": "hi", "max_tokens": 2, "temperature": 0.0}));
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
}
