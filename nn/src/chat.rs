//! Chat templates (feature `chat`): the Jinja template of `tokenizer_config.json`, rendered
//! with minijinja the way transformers' `apply_chat_template` renders it
//! with Jinja2 (`trim_blocks` and `lstrip_blocks`, loop controls,
//! `raise_exception`, Python string methods, the special tokens as
//! variables, and transformers' own `tojson`: Python's `json.dumps`, not
//! Jinja's HTML-escaping filter), and `strftime_now(format)`: the local time
//! as Python's `datetime.now().strftime(format)` gives it.
use kiln_tensor::{Error, Result};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, ErrorKind, Value};
use serde::Serialize;
use std::path::Path;

/// One message of a conversation.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// Its text.
    pub content: String,
}

/// A model's chat template and the special tokens it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Whether it came from the model (otherwise kiln's plain fallback).
    pub from_model: bool,
    source: String,
}

/// The template for models that bring none (`train_llama`'s byte-level
/// models): each message on a line as `role: content`, then `assistant: `.
const FALLBACK: &str =
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";

/// A special token as `tokenizer_config.json` writes it: a string or an
/// `AddedToken` object with a `content`.
fn token(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of `dir/tokenizer_config.json` (its `chat_template`, or
    /// `chat_template.jinja` beside it), else the fallback.
    pub fn for_model(dir: &Path) -> Result<ChatTemplate> {
        let cfg: serde_json::Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| Error::invalid("serve", format!("malformed tokenizer_config.json: {e}")))?,
            Err(_) => serde_json::Value::Null,
        };
        let source = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: the "default" one.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let from_model = source.is_some();
        let t = ChatTemplate::new(source.as_deref().unwrap_or(FALLBACK), from_model)?;
        Ok(ChatTemplate { bos: token(cfg.get("bos_token")), eos: token(cfg.get("eos_token")), ..t })
    }

    /// A template from its source.
    pub fn new(source: &str, from_model: bool) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::invalid("serve", format!("the chat template does not parse: {e}")))?;
        Ok(ChatTemplate { env, bos: String::new(), eos: String::new(), from_model, source: source.to_string() })
    }

    /// With these special tokens as `bos_token` and `eos_token`.
    pub fn with_special_tokens(mut self, bos: &str, eos: &str) -> ChatTemplate {
        self.bos = bos.to_string();
        self.eos = eos.to_string();
        self
    }

    /// The prompt text of `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        self.render_conversation(messages, true)
    }

    /// The text of `messages` as the template renders them, with the
    /// assistant's turn opened at the end when `add_generation_prompt`
    /// (transformers' `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)`).
    pub fn render_conversation(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render_conversation`] for messages of any shape
    /// (OpenAI's, with `tool_calls` and `tool` messages) and, when given, the
    /// tools' definitions as the template's `tools` (transformers'
    /// `apply_chat_template(messages, tools=tools, ...)`).
    pub fn render_with_tools<M: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self.env.get_template("chat").map_err(|e| Error::invalid("serve", e.to_string()))?;
        t.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| Error::invalid("serve", format!("cannot render the chat template: {e}")))
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// transformers' `strftime_now`: the local time in a strftime `format`; a
/// directive chrono does not know is a template error, not a panic.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    strftime(&chrono::Local::now(), &format)
}

fn strftime<Tz: chrono::TimeZone>(
    t: &chrono::DateTime<Tz>,
    format: &str,
) -> std::result::Result<String, minijinja::Error>
where
    Tz::Offset: std::fmt::Display,
{
    let items = chrono::format::StrftimeItems::new(format).parse().map_err(|_| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: bad format {format:?}"))
    })?;
    Ok(t.format_with_items(items.iter()).to_string())
}

/// transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` with those keyword arguments.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let seps: Option<Vec<String>> = kwargs.get("separators")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or_default().to_string()),
        },
    };
    let (item, key) = match seps.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        _ => ((if indent.is_some() { "," } else { ", " }).to_string(), ": ".to_string()),
    };
    let fmt = JsonFmt { ascii: ascii.unwrap_or(false), indent, item, key, sort: sort.unwrap_or(false) };
    let mut out = String::new();
    fmt.value(&value, 0, &mut out)?;
    Ok(out)
}

/// Python's `json.dumps` layout.
struct JsonFmt {
    ascii: bool,
    indent: Option<String>,
    item: String,
    key: String,
    sort: bool,
}

impl JsonFmt {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && (c as u32) > 0x7e) => {
                    let mut buf = [0u16; 2];
                    for u in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{:04x}", u));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    /// A list or an object: `open`, the entries (each written by `entry`)
    /// between separators and line breaks, `close`; empty ones as `[]` / `{}`.
    fn container(
        &self,
        (open, close): (char, char),
        entries: &[Value],
        depth: usize,
        out: &mut String,
        mut entry: impl FnMut(&Value, &mut String) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        for (i, x) in entries.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            self.newline(depth + 1, out);
            entry(x, out)?;
        }
        if !entries.is_empty() {
            self.newline(depth, out);
        }
        out.push(close);
        Ok(())
    }

    fn value(&self, v: &Value, depth: usize, out: &mut String) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => match v.as_i64() {
                Some(i) if !v.to_string().contains('.') => out.push_str(&i.to_string()),
                _ => {
                    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    out.push_str(&if f.is_nan() {
                        "NaN".into()
                    } else if f.is_infinite() {
                        (if f > 0.0 { "Infinity" } else { "-Infinity" }).into()
                    } else {
                        format!("{f:?}")
                    });
                }
            },
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(('[', ']'), &items, depth, out, |x, out| self.value(x, depth + 1, out))?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.container(('{', '}'), &keys, depth, out, |k, out| {
                    self.string(&k.to_string(), out);
                    out.push_str(&self.key);
                    self.value(&v.get_item(k)?, depth + 1, out)
                })?;
            }
            _ => self.string(&v.to_string(), out),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn strftime_formats_as_python_and_refuses_unknown_directives() {
        let t = chrono::Utc.with_ymd_and_hms(2024, 7, 3, 9, 5, 7).unwrap();
        // Python: datetime(2024, 7, 3, 9, 5, 7).strftime(...)
        assert_eq!(strftime(&t, "%d %b %Y").unwrap(), "03 Jul 2024");
        assert_eq!(strftime(&t, "%A %B %-d, %H:%M:%S %j %y %%").unwrap(), "Wednesday July 3, 09:05:07 185 24 %");
        assert!(strftime(&t, "%Q").is_err());
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", true).unwrap().render(&[]).unwrap_err();
        assert!(bad.to_string().contains("bad format"), "{bad}");
    }
}
