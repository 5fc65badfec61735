//! The OpenAI-compatible server (`kiln::nn::serve::openai`, what
//! `examples/serve.rs` runs) against real clients on 127.0.0.1: the official
//! `openai` Python package (in a venv `scripts/setup-openai-venv` sets up)
//! and `curl`. Completions, chat, streaming, concurrent requests, a cancelled
//! stream, malformed and refused requests, and a bounded load test; every
//! answer must equal what `generate()` gives the same request alone. LoRA
//! adapters served by name answer as their merged models do.
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::serve::openai::{router, serve, ChatTemplate, Message, ServerLimits, ServerState};
use kiln::nn::serve::{Engine, EngineConfig, Event, Penalties, Request, TokenLogprobs};
use kiln::prelude::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

mod common;

/// ChatML, as Qwen's tokenizer_config.json writes it.
const TEMPLATE: &str = "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const MAX_CONTEXT: usize = 192;

/// A small byte-level model (no tokenizer.json) with a chat template, saved as
/// a Hugging Face directory.
fn model_dir(dir: &Path) -> LlamaForCausalLM {
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": {MAX_CONTEXT}, "eos_token_id": 10}}"#
    ))
    .unwrap();
    kiln::manual_seed(3);
    let m = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    m.save_pretrained(dir).unwrap();
    let tc = json!({"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": null});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    m
}

fn bytes(s: &str) -> Vec<i64> {
    s.bytes().map(i64::from).collect()
}

/// What the server must answer for `prompt`: generate() alone, the text cut at
/// the end token and at the first stop string, and the tokens it took.
fn expect(m: &LlamaForCausalLM, prompt: &[i64], max: usize, s: &Sampling, stop: Option<&str>) -> Value {
    let p = Tensor::from_vec(prompt.to_vec(), &[1, prompt.len()]).unwrap();
    let out = generate(m, &p, max, &s.clone().with_eos(&[10])).unwrap().to_vec::<i64>().unwrap();
    let mut new: Vec<i64> = out[prompt.len()..].to_vec();
    let mut finish = "length";
    if let Some(i) = new.iter().position(|&t| t == 10) {
        new.truncate(i + 1);
        finish = "stop";
    }
    let text_of = |ids: &[i64]| {
        let b: Vec<u8> = ids.iter().filter(|&&t| t != 10).map(|&t| t as u8).collect();
        String::from_utf8_lossy(&b).into_owned()
    };
    let mut count = new.len();
    let mut text = text_of(&new);
    if let Some(stop) = stop {
        if let Some(n) = (1..=new.len()).find(|&n| text_of(&new[..n]).contains(stop)) {
            count = n;
            let t = text_of(&new[..n]);
            text = t[..t.find(stop).unwrap()].to_string();
            finish = "stop";
        }
    }
    json!({"text": text, "finish_reason": finish, "completion_tokens": count, "prompt_tokens": prompt.len()})
}

fn merge(a: Value, b: Value) -> Value {
    let mut a = a.as_object().unwrap().clone();
    a.extend(b.as_object().unwrap().clone());
    Value::Object(a)
}

#[test]
fn openai_client_and_curl_against_the_server() {
    let _invariant = common::batch_invariance(true);
    // The client's environment first: its script also installs curl when missing.
    let python = common::python_from("setup-openai-venv");
    let dir = std::env::temp_dir().join(format!("kiln-serve-http-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = model_dir(&dir);
    let greedy = Sampling::greedy();
    let sampled = |t: f64, p: f64, seed: u64| Sampling::sample(t).with_top_p(p).with_seed(seed);
    let long_prompt =
        "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. ".to_string();
    let mut completions = vec![];
    for (name, prompt, max, temp, top_p, seed, s) in [
        ("short", "Hello", 12, 0.0, None, None, greedy.clone()),
        ("long", long_prompt.as_str(), 30, 0.0, None, None, greedy.clone()),
        ("sampled", "The ", 20, 0.9, Some(0.95), Some(11u64), sampled(0.9, 0.95, 11)),
    ] {
        let e = expect(&m, &bytes(prompt), max, &s, None);
        completions.push(merge(
            json!({"name": name, "prompt": prompt, "max_tokens": max, "temperature": temp, "top_p": top_p, "seed": seed}),
            e,
        ));
    }
    // A stop string: two characters from the middle of a greedy answer.
    let free = expect(&m, &bytes("abc"), 40, &greedy, None);
    let t: Vec<char> = free["text"].as_str().unwrap().chars().collect();
    let stop: String = t[t.len() / 2..(t.len() / 2 + 2).min(t.len())].iter().collect();
    let e = expect(&m, &bytes("abc"), 40, &greedy, Some(&stop));
    completions
        .push(merge(json!({"name": "stop", "prompt": "abc", "max_tokens": 40, "temperature": 0.0, "stop": [stop]}), e));
    let template = ChatTemplate::for_model(&dir).unwrap();
    let mut chats = vec![];
    for (name, msgs, max, temp, seed, s) in [
        ("chat", vec![("system", "Be brief."), ("user", "Hi there")], 16, 0.0, None, greedy.clone()),
        ("chat-sampled", vec![("user", "Tell me a story")], 16, 0.7, Some(3u64), sampled(0.7, 1.0, 3)),
    ] {
        let msgs: Vec<Message> =
            msgs.iter().map(|(r, c)| Message { role: r.to_string(), content: c.to_string() }).collect();
        let prompt = template.render(&msgs).unwrap();
        let e = expect(&m, &bytes(&prompt), max, &s, None);
        chats.push(merge(
            json!({"name": name, "messages": msgs, "max_tokens": max, "temperature": temp, "seed": seed}),
            e,
        ));
    }
    assert!(template.from_model && template.render(&[]).unwrap().ends_with("<|im_start|>assistant\n"));

    let cfg = EngineConfig { block_size: 8, kv_cache_bytes: 4 << 20, max_batched_tokens: 64, ..Default::default() };
    let state = Arc::new(ServerState::from_dir(&dir, DType::F32, cfg, Some("tiny".into())).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, router(state)).await });

    // curl: a completion, a stream, a malformed body.
    let curl = |args: &[&str]| -> String {
        let out = Command::new("curl").args(["-sS", "--max-time", "60"]).args(args).output().expect("curl");
        assert!(out.status.success(), "curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let c0 = &completions[0];
    let body =
        json!({"model": "tiny", "prompt": c0["prompt"], "max_tokens": c0["max_tokens"], "temperature": 0}).to_string();
    let url = format!("{base}/v1/completions");
    let r: Value = serde_json::from_str(&curl(&["-H", "content-type: application/json", "-d", &body, &url])).unwrap();
    assert_eq!(r["choices"][0]["text"], c0["text"]);
    let body = json!({"model": "tiny", "prompt": c0["prompt"], "max_tokens": c0["max_tokens"], "temperature": 0, "stream": true}).to_string();
    let sse = curl(&["-N", "-H", "content-type: application/json", "-d", &body, &url]);
    let mut text = String::new();
    for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line != "[DONE]" {
            let v: Value = serde_json::from_str(line).unwrap();
            text += v["choices"][0]["text"].as_str().unwrap();
        }
    }
    assert_eq!(text, c0["text"].as_str().unwrap());
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");
    let bad = curl(&["-w", "\n%{http_code}", "-H", "content-type: application/json", "-d", "{\"model\": ", &url]);
    assert!(bad.ends_with("\n400") && bad.contains("invalid_request_error"), "{bad}");
    // min_p (vLLM's extension): a value outside [0, 1] is the API's error naming the field.
    let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 2, "min_p": 1.5}).to_string();
    let bad = curl(&["-w", "\n%{http_code}", "-H", "content-type: application/json", "-d", &body, &url]);
    assert!(
        bad.ends_with("\n400") && bad.contains("min_p must be in [0, 1]") && bad.contains("\"param\":\"min_p\""),
        "{bad}"
    );
    let body = json!({"model": "tiny", "prompt": "x", "max_tokens": 2, "min_p": 0.2, "seed": 1}).to_string();
    let ok: Value = serde_json::from_str(&curl(&["-H", "content-type: application/json", "-d", &body, &url])).unwrap();
    assert_eq!(ok["choices"][0]["finish_reason"], "length", "{ok}");
    let metrics = curl(&[&format!("{base}/metrics")]);
    assert!(metrics.contains("kiln_generated_tokens_total"), "{metrics}");

    // The openai client: everything else, then the load test.
    let exp = json!({"model": "tiny", "completions": completions, "chats": chats, "long_max_tokens": 150,
                     "max_context": MAX_CONTEXT, "load_clients": 6});
    let exp_path = dir.join("expectations.json");
    std::fs::write(&exp_path, exp.to_string()).unwrap();
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai_client.py");
    let out = Command::new(python).arg(&client).arg(&base).arg(&exp_path).arg("8").output().unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client failed:\n{so}\n{se}");
    assert!(so.contains("\"ok\": true"), "{so}");
    eprintln!("{so}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Several LoRA adapters behind one server (`--lora name=DIR`): the
/// `openai` client asks for each by name, concurrently with the base model,
/// and each answer is the merged model's `generate()`; `/v1/models` lists
/// them, and an unknown name is the API's 404.
#[test]
fn openai_client_gets_each_adapters_answers() {
    use kiln::nn::lora::{inject_adapter, merge_and_unload, save_adapter, LoraConfig, LoraInit, TargetModules};
    let _invariant = common::batch_invariance(true);
    let python = common::python_from("setup-openai-venv");
    let dir = std::env::temp_dir().join(format!("kiln-serve-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = model_dir(&dir);
    let prompts = ["Hello there", "The quick brown fox"];
    let mut adapters = vec![];
    let mut cases = vec![];
    for (name, targets, seed) in [
        ("alpha", TargetModules::AllLinear, 5u64),
        ("beta", TargetModules::Names(vec!["q_proj".into(), "v_proj".into(), "down_proj".into()]), 6),
    ] {
        let mut m = model_dir(&dir.join(format!("{name}-base")));
        let mut c = LoraConfig::new(4, targets);
        c.init_lora_weights = LoraInit::Random;
        kiln::manual_seed(seed);
        inject_adapter(&mut m, &c).unwrap();
        let adir = dir.join(name);
        save_adapter(&adir, &m, &c).unwrap();
        adapters.push((name.to_string(), adir));
        merge_and_unload(&mut m).unwrap();
        for p in prompts {
            let e = expect(&m, &bytes(p), 16, &Sampling::greedy(), None);
            cases.push(json!({"model": name, "prompt": p, "text": e["text"]}));
        }
    }
    for p in prompts {
        let e = expect(&base, &bytes(p), 16, &Sampling::greedy(), None);
        cases.push(json!({"model": "tiny", "prompt": p, "text": e["text"]}));
    }
    let texts: Vec<&Value> = cases.iter().map(|c| &c["text"]).collect();
    assert!(texts[0] != texts[2] && texts[0] != texts[4], "the adapters change the answers: {texts:?}");

    let cfg = EngineConfig { block_size: 8, kv_cache_bytes: 4 << 20, max_batched_tokens: 64, ..Default::default() };
    let state =
        Arc::new(ServerState::from_dir_with_adapters(&dir, DType::F32, cfg, Some("tiny".into()), &adapters).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, router(state)).await });
    let client = r#"
import concurrent.futures as cf, json, sys
import openai
url, cases = sys.argv[1], json.loads(sys.argv[2])
client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
ids = sorted(m.id for m in client.models.list().data)
assert ids == ["alpha", "beta", "tiny"], ids
def ask(c):
    r = client.completions.create(model=c["model"], prompt=c["prompt"], max_tokens=16, temperature=0)
    assert r.model == c["model"], (r.model, c["model"])
    return r.choices[0].text
with cf.ThreadPoolExecutor(len(cases)) as ex:
    got = list(ex.map(ask, cases))
for c, g in zip(cases, got):
    assert g == c["text"], (c, g)
try:
    client.completions.create(model="gamma", prompt="x", max_tokens=2)
    raise SystemExit("an unknown adapter was served")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
print(json.dumps({"ok": True, "answers": len(got)}))
"#;
    let out =
        Command::new(python).arg("-c").arg(client).arg(&url).arg(Value::from(cases).to_string()).output().unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && so.contains("\"ok\": true"), "the openai client failed:\n{so}\n{se}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Chat templates render as transformers' `apply_chat_template` renders them
/// with Jinja2 (its `render_jinja_template`, in the transformers venv):
/// whitespace control, trim/lstrip blocks, namespaces, slicing, Python string
/// methods, `raise_exception`, and transformers' `tojson` (Python's
/// `json.dumps`, not Jinja's HTML-escaping filter), `strftime_now`.
#[test]
fn chat_templates_render_as_transformers_does() {
    let templates = [
        TEMPLATE.to_string(),
        concat!(
            "{{- bos_token }}{%- set ns = namespace(sys='') %}{%- if messages[0]['role'] == 'system' %}",
            "{%- set ns.sys = messages[0]['content'] | trim %}{%- set rest = messages[1:] %}{%- else %}",
            "{%- set rest = messages %}{%- endif %}{%- if ns.sys %}<|start_header_id|>system<|end_header_id|>\n\n",
            "{{ ns.sys }}<|eot_id|>{%- endif %}{%- for m in rest %}{%- if m['role'] not in ['user', 'assistant'] %}",
            "{{ raise_exception('unknown role ' + m['role']) }}{%- endif %}<|start_header_id|>{{ m['role'] }}",
            "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{%- endfor %}{%- if add_generation_prompt %}",
            "<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
        )
        .to_string(),
        concat!(
            "{% for message in messages %}{% if message.content.startswith('/') %}[command]",
            "{{ message.content.split(' ')[0] | tojson }}{% else %}{{ message.role | upper }}: ",
            "{{ message.content | tojson }} {{ {'role': message.role, 'n': loop.index, 'ok': true, 'x': none} | tojson }}",
            "{% endif %}{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}\nASSISTANT:",
            "{% endif %}{{ eos_token }}{{ messages | map(attribute='role') | list | tojson(indent=2) }}"
        )
        .to_string(),
        // Llama 3.1's date line (the local date; Python's `datetime.now().strftime`).
        "{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n' }}{{ strftime_now('%A %B %j %y %m %%') }}".to_string(),
        "{% for m in messages %}\n    {% if m.role == 'user' %}\nUser: {{ m.content }}\n    {% else %}\n{{ m.role }}: {{ m.content }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nAssistant:\n{% endif %}\n".to_string(),
    ];
    let messages = vec![
        Message { role: "system".into(), content: "  You are terse.  ".into() },
        Message {
            role: "user".into(),
            content: "Hi \"there\" <b> & 'friends' \u{2014} \u{fc}n\u{ef}c\u{f6}d\u{e9}\\\nline2\ttab".into(),
        },
        Message { role: "assistant".into(), content: "Hello!".into() },
        Message { role: "user".into(), content: "/help me".into() },
    ];
    let (bos, eos) = ("<s>", "</s>");
    let ours: Vec<String> = templates
        .iter()
        .map(|t| ChatTemplate::new(t, true).unwrap().with_special_tokens(bos, eos).render(&messages).unwrap())
        .collect();
    let dir = std::env::temp_dir().join(format!("kiln-chat-templates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("input.json");
    std::fs::write(&input, json!({"templates": templates, "messages": messages, "bos": bos, "eos": eos}).to_string())
        .unwrap();
    let python = common::python_from("setup-transformers-venv");
    let code = "import json, sys\nfrom transformers.utils.chat_template_utils import render_jinja_template\n\
        d = json.load(open(sys.argv[1]))\nout = []\nfor t in d['templates']:\n\
        \x20   r = render_jinja_template([d['messages']], chat_template=t, add_generation_prompt=True, bos_token=d['bos'], eos_token=d['eos'])\n\
        \x20   out.append(r[0][0])\nprint(json.dumps(out))\n";
    let out = Command::new(python).arg("-c").arg(code).arg(&input).output().unwrap();
    assert!(out.status.success(), "transformers failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let theirs: Vec<String> = serde_json::from_slice(out.stdout.trim_ascii()).unwrap();
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "template {i}: kiln's rendering differs from transformers'");
    }
    // An unknown role reaches raise_exception: an error, as in transformers.
    let bad = vec![Message { role: "tool".into(), content: "x".into() }];
    let e = ChatTemplate::new(&templates[1], true).unwrap().render(&bad).unwrap_err().to_string();
    assert!(e.contains("unknown role tool"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The engine's own answer to each request (tokens up to and without the end
/// token, and their log-probabilities): what the server must send back.
fn engine_answers(m: &LlamaForCausalLM, reqs: &[Request]) -> Vec<(Vec<i64>, Vec<TokenLogprobs>, usize)> {
    let cfg = EngineConfig { block_size: 8, ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let ids: Vec<u64> = reqs.iter().map(|r| engine.add_request(r.clone().with_stop_tokens(&[10])).unwrap()).collect();
    let mut got: std::collections::BTreeMap<u64, (Vec<i64>, Vec<TokenLogprobs>, usize)> = Default::default();
    while engine.has_work() {
        for o in engine.step() {
            if let Event::Token(t, lp) = o.event {
                let e = got.entry(o.id).or_default();
                e.2 += 1;
                if t != 10 {
                    e.0.push(t);
                    e.1.extend(lp);
                }
            }
        }
    }
    ids.iter().map(|id| got.remove(id).unwrap()).collect()
}

/// The OpenAI sampling surface through the `openai` client, plain and
/// streamed: logprobs (completions and chat), `n` choices, penalties and
/// `logit_bias`, `echo`, `stream_options.include_usage`; every answer equals
/// the engine's own for the same request, and fields the server does not
/// honour or values out of range get OpenAI's 400 naming them.
#[test]
fn openai_client_sampling_surface() {
    let _invariant = common::batch_invariance(true);
    let python = common::python_from("setup-openai-venv");
    let dir = std::env::temp_dir().join(format!("kiln-serve-sampling-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = model_dir(&dir);
    let template = ChatTemplate::for_model(&dir).unwrap();
    let chat_prompt = template.render(&[Message { role: "user".into(), content: "Name a colour".into() }]).unwrap();
    let sampled = |seed: u64| Sampling::sample(0.9).with_seed(seed);
    let pens = Penalties { repetition: 1.3, presence: 0.6, frequency: 0.5 };
    let reqs = vec![
        Request::new(bytes("Hello"), 8).with_logprobs(3),
        Request::new(bytes(&chat_prompt), 8).with_logprobs(2),
        Request::new(bytes("Once upon"), 10).with_sampling(sampled(5)),
        Request::new(bytes("Once upon"), 10).with_sampling(sampled(6)),
        Request::new(bytes("Once upon"), 10).with_sampling(sampled(7)),
        Request::new(bytes("abcabc"), 12).with_penalties(pens).with_logit_bias(&[(b'x' as i64, 4.0)]),
        Request::new(bytes("abcabc"), 12),
    ];
    let answers = engine_answers(&m, &reqs);
    let text = |t: &[i64]| String::from_utf8_lossy(&t.iter().map(|&x| x as u8).collect::<Vec<_>>()).into_owned();
    let exp: Vec<Value> = answers
        .iter()
        .map(|(t, lp, n)| {
            json!({"text": text(t), "generated": n, "logprobs": lp.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                   "top": lp.iter().map(|l| l.top.iter().map(|x| x.1).collect::<Vec<_>>()).collect::<Vec<_>>()})
        })
        .collect();
    assert_ne!(exp[5]["text"], exp[6]["text"], "the penalties change the answer");

    let cfg = EngineConfig { block_size: 8, kv_cache_bytes: 4 << 20, max_batched_tokens: 64, ..Default::default() };
    let state = Arc::new(ServerState::from_dir(&dir, DType::F32, cfg, Some("tiny".into())).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, router(state)).await });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai_sampling.py");
    let out = Command::new(python).arg(&script).arg(&url).arg(Value::from(exp).to_string()).output().unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && so.contains("\"ok\": true"), "the openai client failed:\n{so}\n{se}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Qwen2.5's way of showing tools (Hermes-style `<tool_call>` blocks).
const HERMES_TEMPLATE: &str = r#"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"#;

fn tools_json() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
         "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "The time now.",
         "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}
    ])
}

/// A conversation with a tool round trip renders with tools as
/// transformers' `apply_chat_template(messages, tools=tools)` renders it.
#[test]
fn tool_conversations_render_as_transformers_does() {
    let tools = tools_json();
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}
    ]);
    let t = ChatTemplate::new(HERMES_TEMPLATE, true).unwrap();
    let ours = t.render_with_tools(messages.as_array().unwrap(), Some(tools.as_array().unwrap()), true).unwrap();
    let python = common::python_from("setup-transformers-venv");
    let code = "import json, sys\nfrom transformers.utils.chat_template_utils import render_jinja_template\n\
        d = json.loads(sys.argv[1])\n\
        r = render_jinja_template([d['messages']], tools=d['tools'], chat_template=d['template'], add_generation_prompt=True)\n\
        print(json.dumps(r[0][0]))\n";
    let arg = json!({"messages": messages, "tools": tools, "template": HERMES_TEMPLATE}).to_string();
    let out = Command::new(python).arg("-c").arg(code).arg(arg).output().unwrap();
    assert!(out.status.success(), "transformers failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let theirs: String = serde_json::from_slice(out.stdout.trim_ascii()).unwrap();
    assert_eq!(ours, theirs);
    assert!(ours.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), "{ours}");
}

/// Tool calls through the `openai` client: `required` and a named choice
/// give calls to the tools with arguments that follow their schemas, plain
/// and streamed; `auto` parses a `<tool_call>` block the model wrote (here
/// steered there by a regex); a round trip with `tool` messages is served;
/// unknown tools and bad schemas are the API's 400s.
#[test]
fn openai_client_tool_calls() {
    let python = common::python_from("setup-openai-venv");
    let dir = std::env::temp_dir().join(format!("kiln-serve-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1536, "eos_token_id": 10}"#,
    )
    .unwrap();
    kiln::manual_seed(4);
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap().save_pretrained(&dir).unwrap();
    let tc = json!({"chat_template": HERMES_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": null});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    let cfg = EngineConfig { block_size: 16, kv_cache_bytes: 8 << 20, ..Default::default() };
    let state = Arc::new(ServerState::from_dir(&dir, DType::F32, cfg, Some("tiny".into())).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, router(state)).await });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai_tools.py");
    let out = Command::new(python).arg(&script).arg(&url).arg(tools_json().to_string()).output().unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && so.contains("\"ok\": true"), "the openai client failed:\n{so}\n{se}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Starts `state` behind `serve` (Note [Facing a network]) on a port of its
/// own; returns its base URL.
fn start_limited(rt: &tokio::runtime::Runtime, state: ServerState) -> String {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let limits = state.limits.clone();
    let app = router(Arc::new(state));
    rt.spawn(async move { serve(listener, app, &limits).await });
    base
}

/// A server that faces a network: the `openai` client with the right key is
/// served and without it gets OpenAI's 401; prompts, outputs and bodies past
/// their bounds are refused; a request past its time gets a 504 (or an error
/// event when streamed); idle connections are closed and connections past the
/// bound wait for one to close.
#[test]
fn a_server_facing_the_network() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let python = common::python_from("setup-openai-venv");
    let dir = std::env::temp_dir().join(format!("kiln-serve-net-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    model_dir(&dir);
    let cfg = || EngineConfig { block_size: 8, kv_cache_bytes: 4 << 20, ..Default::default() };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut state = ServerState::from_dir(&dir, DType::F32, cfg(), Some("tiny".into())).unwrap();
    state.limits = ServerLimits {
        api_key: Some("sk-kiln-test".into()),
        max_prompt_tokens: Some(128),
        max_output_tokens: Some(24),
        max_body_bytes: 4096,
        max_connections: 2,
        idle_timeout: Duration::from_millis(1500),
        ..Default::default()
    };
    let base = start_limited(&rt, state);
    let mut slow = ServerState::from_dir(&dir, DType::F32, cfg(), Some("tiny".into())).unwrap();
    slow.limits.request_timeout = Duration::from_millis(1);
    let slow_base = start_limited(&rt, slow);

    let client = r#"
import json, sys, httpx, openai
base, slow = sys.argv[1], sys.argv[2]
ok = openai.OpenAI(base_url=base + "/v1", api_key="sk-kiln-test", max_retries=0, timeout=60)
r = ok.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0)
assert r.choices[0].finish_reason in ("stop", "length"), r
# No max_tokens: at most the server's bound.
r = ok.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0)
assert r.usage.completion_tokens <= 24, r.usage
for key in ["sk-wrong", "sk-kiln-tes", "sk-kiln-test2"]:
    try:
        openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0).models.list()
        raise SystemExit(f"key {key} was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
r = httpx.get(base + "/v1/models")
assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", r.text
assert httpx.get(base + "/health").status_code == 200
for kw, param in [(dict(prompt="p" * 200, max_tokens=2), "prompt"), (dict(prompt="p", max_tokens=25), "max_tokens")]:
    try:
        ok.completions.create(model="tiny", **kw)
        raise SystemExit(f"{param} past its bound was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == param, e.body
r = httpx.post(base + "/v1/completions", headers={"authorization": "Bearer sk-kiln-test"},
               json={"model": "tiny", "prompt": "x" * 5000, "max_tokens": 1})
assert r.status_code == 413, (r.status_code, r.text)
s = openai.OpenAI(base_url=slow + "/v1", api_key="none", max_retries=0)
try:
    # The end token barred: the request cannot finish before its time.
    s.completions.create(model="tiny", prompt="Hi", max_tokens=64, logit_bias={"10": -100})
    raise SystemExit("a request past its time was answered")
except openai.APIStatusError as e:
    assert e.status_code == 504 and e.body["code"] == "timeout", e.body
events = [l for l in httpx.post(slow + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 64,
          "logit_bias": {"10": -100}, "stream": True}).text.splitlines() if l.startswith("data: ")]
assert "did not finish within" in events[-2] and events[-1] == "data: [DONE]", events
ok.completions.create(model="tiny", prompt="Hi", max_tokens=5)
print(json.dumps({"ok": True}))
"#;
    let slow_url = slow_base.clone();
    let out = Command::new(&python).arg("-c").arg(client).arg(&base).arg(&slow_url).output().unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && so.contains("\"ok\": true"), "the openai client failed:\n{so}\n{se}");

    // Idle connections are closed; past the bound, a connection waits.
    let addr = base.trim_start_matches("http://").to_string();
    let t0 = Instant::now();
    let idle: Vec<std::net::TcpStream> = (0..2).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = std::net::TcpStream::connect(&addr).unwrap();
    third.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
    third.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut answer = String::new();
    third.read_to_string(&mut answer).unwrap();
    let waited = t0.elapsed();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Served once an idle connection was closed at its timeout (1.5 s), not before.
    assert!(waited >= Duration::from_millis(1400), "served after {waited:?} with both slots taken");
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(c.read(&mut buf).unwrap_or(0), 0, "an idle connection was left open");
    }
    std::fs::remove_dir_all(&dir).ok();
}
