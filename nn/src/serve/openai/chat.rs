//! Chat templates: the Jinja template of `tokenizer_config.json`, rendered
//! with minijinja the way transformers' `apply_chat_template` renders it
//! (`trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
//! `tojson`, Python string methods, the special tokens as variables).
use kiln_tensor::{Error, Result};
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
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::invalid("serve", format!("the chat template does not parse: {e}")))?;
        Ok(ChatTemplate { env, bos: String::new(), eos: String::new(), from_model })
    }

    /// The prompt text of `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        let t = self.env.get_template("chat").map_err(|e| Error::invalid("serve", e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| Error::invalid("serve", format!("cannot render the chat template: {e}")))
    }
}
