//! `arbor generate` / `score` end to end on a tiny model made by `arbor make-model`:
//! the terminal listing, the JSONL schema, score == generate bit for bit across TP sizes,
//! and `--shadow-tp1`.

mod cli_support;

use std::sync::OnceLock;

use cli_support::*;
use serde_json::Value;

/// One tiny Llama shared by the tests of this file.
fn model() -> &'static str {
    static DIR: OnceLock<String> = OnceLock::new();
    DIR.get_or_init(|| {
        shared_tiny("model-cli-llama", "llama")
            .to_string_lossy()
            .into_owned()
    })
}

/// `generate --model <the tiny model>` followed by `rest`.
fn generate_args<'a>(rest: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["generate", "--model", model()];
    args.extend_from_slice(rest);
    args
}

fn prompts_file(dir: &std::path::Path) -> String {
    let p = dir.join("prompts.jsonl");
    std::fs::write(
        &p,
        "{\"id\":3,\"prompt\":\"The quick brown fox\"}\n\
         {\"id\":10,\"tokens\":[5,17,29,41,53,65,77,89,101]}\n\
         {\"id\":4,\"prompt\":\"a\"}\n",
    )
    .expect("write prompts");
    p.to_string_lossy().into_owned()
}

#[test]
fn generate_prints_a_listing_from_rank_zero_only() {
    let o = run_launched(
        2,
        &generate_args(&["--prompt", "Hello there", "--max-tokens", "4"]),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert_eq!(
        out.matches("[0]").count(),
        1,
        "one listing (rank 0 only):\n{out}"
    );
    assert!(out.contains("prompt: \"Hello there\""), "{out}");
    assert!(out.contains("output: "), "{out}");
    assert!(out.contains(" new ("), "{out}");
    assert!(!err.contains("panicked"), "{err}");
    // One timing line, from rank 0: 4 new tokens = the prefill step and 3 decode steps.
    let all = format!("{out}{err}");
    assert_eq!(
        all.matches("timing (rank 0, TP 2): prefill").count(),
        1,
        "{all}"
    );
    assert!(all.contains("decode 3 steps in "), "{all}");
}

#[test]
fn generate_jsonl_schema() {
    let s = Scratch::new("model-cli-schema");
    let prompts = prompts_file(s.path());
    let out = s.path().join("gen.jsonl");
    let o = run_launched(
        2,
        &generate_args(&[
            "--prompts",
            &prompts,
            "--max-tokens",
            "6",
            "--logprobs",
            "3",
            "--batch",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]),
    );
    let (stdout, err) = text(&o);
    assert!(o.status.success(), "{stdout}\n{err}");
    assert!(
        stdout.trim().is_empty(),
        "nothing on stdout with --out: {stdout}"
    );
    let recs = read_jsonl(&out);
    assert_eq!(
        recs.iter()
            .map(|r| r["id"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![3, 10, 4]
    );
    for r in &recs {
        let n = r["tokens"].as_array().unwrap().len();
        let finish = r["finish"].as_str().unwrap();
        assert!(
            finish == "length" && n == 6 || finish == "eos" && (1..=6).contains(&n),
            "{r}"
        );
        assert!(!r["prompt_tokens"].as_array().unwrap().is_empty());
        assert!(r["text"].is_string(), "{r}");
        let lps = r["logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), n);
        assert!(
            lps.iter().all(|l| l.as_f64().is_some_and(|v| v <= 0.0)),
            "{r}"
        );
        let top = r["top"].as_array().unwrap();
        assert_eq!(top.len(), n);
        for (j, alts) in top.iter().enumerate() {
            let alts = alts.as_array().unwrap();
            assert_eq!(alts.len(), 3);
            let lp: Vec<f64> = alts
                .iter()
                .map(|a| a["logprob"].as_f64().unwrap())
                .collect();
            assert!(lp.windows(2).all(|w| w[0] >= w[1]), "top sorted: {lp:?}");
            assert!(lps[j].as_f64().unwrap() <= lp[0]);
            assert!(alts.iter().all(|a| a["token"].is_u64()));
        }
        let dg = r["logits_digest"].as_array().unwrap();
        assert_eq!(dg.len(), n);
        assert!(dg.iter().all(|d| d
            .as_str()
            .is_some_and(|h| h.len() == 16 && h.chars().all(|c| c.is_ascii_hexdigit()))));
    }
    assert_eq!(
        recs[1]["prompt_tokens"],
        serde_json::json!([5, 17, 29, 41, 53, 65, 77, 89, 101])
    );
}

/// Generate at one TP, score at another; log-probs and digests bit for bit (as text: the
/// shortest decimal of an f32 is unique, so equal text is equal bits).
fn score_equals_generate(gen_tp: usize, score_tp: usize, score_flags: &[&str]) {
    let s = Scratch::new("model-cli-score");
    let prompts = prompts_file(s.path());
    let gen = s.path().join("gen.jsonl");
    let score = s.path().join("score.jsonl");
    let o = run_launched(
        gen_tp,
        &generate_args(&[
            "--prompts",
            &prompts,
            "--max-tokens",
            "5",
            "--temperature",
            "0.9",
            "--seed",
            "11",
            "--batch",
            "3",
            "--out",
            gen.to_str().unwrap(),
        ]),
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let o = run_launched(
        score_tp,
        &[
            "score",
            "--model",
            model(),
            "--input",
            gen.to_str().unwrap(),
            "--batch",
            "1",
            "--out",
            score.to_str().unwrap(),
        ]
        .into_iter()
        .chain(score_flags.iter().copied())
        .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let (g, sc) = (read_jsonl(&gen), read_jsonl(&score));
    assert_eq!(g.len(), sc.len());
    for (a, b) in g.iter().zip(&sc) {
        assert_eq!(a["id"], b["id"]);
        let mut seq = a["prompt_tokens"].as_array().unwrap().clone();
        seq.extend(a["tokens"].as_array().unwrap().iter().cloned());
        assert_eq!(b["tokens"], Value::Array(seq));
        assert_eq!(
            b["prompt_len"].as_u64().unwrap() as usize,
            a["prompt_tokens"].as_array().unwrap().len()
        );
        assert_eq!(
            a["logprobs"].to_string(),
            b["logprobs"].to_string(),
            "request {}",
            a["id"]
        );
        assert_eq!(
            a["logits_digest"], b["logits_digest"],
            "request {}",
            a["id"]
        );
    }
}

#[test]
fn score_equals_generate_tp2_to_tp1() {
    score_equals_generate(2, 1, &[]);
}

#[test]
fn score_equals_generate_tp1_to_tp4() {
    // Scored in steps of at most 2 rows: the sequences in chunks, the same bits.
    score_equals_generate(1, 4, &["--max-num-batched-tokens", "2"]);
}

/// Offline commands size a step from their work; a smaller step prefills the prompts in
/// chunks and changes no bit. 0 rows is refused by the flag's name.
#[test]
fn a_smaller_step_changes_no_bit() {
    let s = Scratch::new("model-cli-step");
    let prompts = prompts_file(s.path());
    let run = |name: &str, extra: &[&str]| {
        let out = s.path().join(name);
        let mut a = generate_args(&["--prompts", &prompts, "--max-tokens", "4", "--batch", "3"]);
        a.extend_from_slice(extra);
        a.extend(["--out", out.to_str().unwrap()]);
        let o = run_launched(2, &a);
        assert!(o.status.success(), "{:?}", text(&o));
        read_jsonl(&out)
    };
    let whole = run("whole.jsonl", &[]);
    let chunked = run("chunked.jsonl", &["--max-num-batched-tokens", "3"]);
    assert_eq!(whole, chunked);
    let o = run_arbor(&generate_args(&[
        "--prompt",
        "a",
        "--max-num-batched-tokens",
        "0",
    ]));
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("--max-num-batched-tokens"), "{err}");
}

#[test]
fn shadow_tp1_passes_and_changes_nothing() {
    let s = Scratch::new("model-cli-shadow");
    let prompts = prompts_file(s.path());
    let plain = s.path().join("plain.jsonl");
    let shadow = s.path().join("shadow.jsonl");
    let common = generate_args(&["--prompts", &prompts, "--max-tokens", "4", "--batch", "3"]);
    let mut a: Vec<&str> = common.to_vec();
    a.extend(["--out", plain.to_str().unwrap()]);
    let o = run_launched(4, &a);
    assert!(o.status.success(), "{:?}", text(&o));
    let mut b: Vec<&str> = common.to_vec();
    b.extend(["--shadow-tp1", "--out", shadow.to_str().unwrap()]);
    let o = run_launched(4, &b);
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "--shadow-tp1 at TP=4 failed:\n{out}\n{err}"
    );
    assert_eq!(read_jsonl(&plain), read_jsonl(&shadow));
}

#[test]
fn jsonl_to_stdout() {
    let o = run_arbor(&generate_args(&[
        "--prompt",
        "x y z",
        "--max-tokens",
        "2",
        "--jsonl",
    ]));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["tokens"].as_array().unwrap().len(), 2);
}

/// `arbor demo` as after `cargo run -- demo` on a fresh clone: no arbor-launch binary
/// next to arbor (the launcher library runs in-process), no model yet.
#[test]
fn demo_without_a_launcher_binary() {
    let s = Scratch::new("model-cli-demo");
    let bin = s.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("arbor");
    // A hard link, not a copy: a freshly written executable can fail to start with
    // ETXTBSY while other test threads fork.
    std::fs::hard_link(arbor(), &exe).unwrap();
    let dir = s.path().join("demo-model");
    let o = std::process::Command::new(&exe)
        .args(["demo", "--max-tokens", "4", "--dir", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("making the tiny Llama model"), "{err}");
    assert!(dir.join("config.json").is_file());
    assert!(
        out.contains("unique outputs") && out.contains("top-5 divergence"),
        "{out}"
    );
    assert!(
        out.contains("RESULT: bit-identical across all 12 configurations"),
        "{out}"
    );
    // A second run reuses the model.
    let o = std::process::Command::new(&exe)
        .args(["demo", "--max-tokens", "2", "--dir", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("using the tiny model"), "{err}");
}

#[test]
fn bench_decode_reports_every_batch_at_tp2() {
    let dir = Scratch::new("bench-decode");
    let json = dir.path().join("decode.json");
    let json_s = json.to_string_lossy().into_owned();
    let out = run_launched(
        2,
        &[
            "bench",
            "decode",
            "--model",
            model(),
            "--batch",
            "1,3",
            "--prompt-len",
            "6",
            "--steps",
            "5",
            "--out",
            &json_s,
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("TP 2 invariant batch   3: decode"),
        "{stdout}"
    );
    let rows: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 2);
    for (row, batch) in rows.iter().zip([1u64, 3]) {
        assert_eq!(row["tp"], 2);
        assert_eq!(row["batch"], batch);
        assert_eq!(row["numerics"], "invariant");
        // 5 new tokens: one from the prefill, 4 decode steps of `batch` tokens each.
        assert_eq!(row["decode_steps"], 4);
        assert_eq!(row["prefill_tokens"], 6 * batch);
        assert!(row["decode_ms_per_step"].as_f64().unwrap() > 0.0);
        assert!(row["weight_bytes_per_rank"].as_u64().unwrap() > 0);
    }
}

#[test]
fn bench_decode_samples_with_temperature_and_top_k() {
    let dir = Scratch::new("bench-decode-sampled");
    let json = dir.path().join("decode.json");
    let json_s = json.to_string_lossy().into_owned();
    for extra in [
        &["--temperature", "0.7"][..],
        &["--temperature", "0.7", "--top-k", "5"],
    ] {
        let mut args = vec![
            "bench",
            "decode",
            "--model",
            model(),
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--steps",
            "4",
            "--out",
            &json_s,
        ];
        args.extend_from_slice(extra);
        let out = run_arbor(&args);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(stdout.contains("TP 1 invariant T=0.7"), "{stdout}");
        let rows: Vec<Value> =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let t = rows[0]["temperature"].as_f64().unwrap();
        assert!((t - 0.7).abs() < 1e-6, "{t}");
        assert_eq!(rows[0]["top_k"], if extra.len() == 4 { 5 } else { 0 });
    }
    let out = run_arbor(&["bench", "decode", "--model", model(), "--temperature=-1"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("temperature must be finite and >= 0"),
        "{stderr}"
    );
}

#[test]
fn fast_numerics_are_refused_on_the_cpu_with_a_reason() {
    let out = run_arbor(&generate_args(&["--prompt", "hi", "--numerics", "fast"]));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--numerics fast needs --device cuda"),
        "{stderr}"
    );
    let out = run_arbor(&generate_args(&["--prompt", "hi", "--numerics", "fastest"]));
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("invalid value 'fastest'"),
        "{}",
        text(&out).1
    );
}

/// A top-k draw takes its token from the backend's top-k candidates when the row is not
/// needed on the host, and from the whole row when it is (top-N log-probs asked): the two
/// must give the same tokens, log-probs and digests.
#[test]
fn top_k_tokens_do_not_depend_on_whether_the_row_came_to_the_host() {
    let s = Scratch::new("model-cli-topk");
    let prompts = prompts_file(s.path());
    let run = |name: &str, extra: &[&str]| {
        let out = s.path().join(name);
        let mut a = generate_args(&[
            "--prompts",
            &prompts,
            "--max-tokens",
            "12",
            "--temperature",
            "0.9",
            "--top-k",
            "20",
            "--top-p",
            "0.95",
            "--seed",
            "7",
        ]);
        a.extend_from_slice(extra);
        a.extend(["--out", out.to_str().unwrap()]);
        let o = run_arbor(&a);
        assert!(o.status.success(), "{:?}", text(&o));
        read_jsonl(&out)
    };
    let candidates = run("candidates.jsonl", &[]);
    let rows = run("rows.jsonl", &["--logprobs", "3"]);
    assert_eq!(candidates.len(), rows.len());
    for (c, r) in candidates.iter().zip(&rows) {
        for key in ["tokens", "logprobs", "logits_digest"] {
            assert_eq!(c[key], r[key], "{key}: {c} vs {r}");
        }
    }
}

/// Logs written to a pipe (the launcher's, a file's) carry no ANSI colour codes.
#[test]
fn logs_to_a_pipe_have_no_colour_codes() {
    let o = std::process::Command::new(launcher())
        .args(["-n", "2", "--"])
        .arg(arbor())
        .args(generate_args(&["--prompt", "Hi", "--max-tokens", "2"]))
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .output()
        .expect("start arbor-launch");
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("INFO"), "no log lines to look at:\n{err}");
    assert!(!err.contains('\u{1b}'), "colour codes in logs:\n{err:?}");
}

/// `generate`'s JSONL records are the same bytes with and without the prefix cache and at
/// TP 1 and 4, for prompts of 600 to 1000 tokens (attention splits of 512) that share a
/// long prefix, in batches whose later ones reuse the earlier ones' blocks.
#[test]
fn long_shared_prompts_generate_the_same_bytes_with_and_without_the_prefix_cache() {
    let s = Scratch::new("model-cli-prefix");
    let shared: Vec<u32> = (0..520u32).map(|i| 3 + (i * 37 + 11) % 250).collect();
    let mut lines = String::new();
    for k in 0..5u32 {
        let mut t = shared.clone();
        t.extend((0..100 * k + 80).map(|i| 3 + (i * 13 + k * 7) % 250));
        lines.push_str(&serde_json::json!({"id": k, "tokens": t}).to_string());
        lines.push('\n');
    }
    let prompts = s.path().join("long.jsonl");
    std::fs::write(&prompts, lines).expect("write prompts");
    let run = |tp: usize, extra: &[&str], tag: &str| -> Vec<u8> {
        let out = s.path().join(format!("{tag}.jsonl"));
        let mut args = generate_args(&[
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-tokens",
            "5",
            "--logprobs",
            "2",
            "--temperature",
            "0.8",
            "--seed",
            "3",
            "--batch",
            "2",
            "--max-seq-len",
            "1100",
            "--out",
            out.to_str().unwrap(),
        ]);
        args.extend_from_slice(extra);
        let o = run_launched(tp, &args);
        let (so, se) = text(&o);
        assert!(o.status.success(), "{tag}: {so}\n{se}");
        std::fs::read(&out).expect("read records")
    };
    let want = run(1, &["--no-prefix-cache"], "tp1-off");
    assert_eq!(want.iter().filter(|&&b| b == b'\n').count(), 5);
    assert_eq!(run(1, &[], "tp1-on"), want, "TP 1 with the prefix cache");
    assert_eq!(run(4, &[], "tp4-on"), want, "TP 4 with the prefix cache");
    // A cache of 20 blocks: batches wait for blocks, cached ones are evicted.
    assert_eq!(
        run(2, &["--kv-blocks", "20"], "tp2-small"),
        want,
        "TP 2 with a small cache"
    );
}
