//! `LoraConfig`: PEFT's `LoraConfig` as `adapter_config.json` writes it, and
//! PEFT's rules for which modules it selects (`target_modules` as names or
//! a regex, `"all-linear"`, `exclude_modules`, `rank_pattern` and
//! `alpha_pattern`).
use super::adapter::LoraInit;
use kiln_tensor::{Error, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The modules an adapter goes on (PEFT's `target_modules`).
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// Module names: a module is selected when its full name is one of them
    /// or ends with `.` and one of them (`"q_proj"` selects every
    /// `….self_attn.q_proj`).
    Names(Vec<String>),
    /// A regular expression that must match a module's whole name
    /// (Python's `re.fullmatch`).
    Regex(String),
    /// `"all-linear"`: every `Linear` but the output layer (`lm_head`).
    AllLinear,
}

/// PEFT's `LoraConfig` (the fields kiln honours; a file setting any other
/// field to something other than its inert default is refused by
/// [`LoraConfig::from_json`], never ignored).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank of every adapter (`r`), unless `rank_pattern` names another.
    pub r: usize,
    /// `lora_alpha`: the scaling is `lora_alpha / r` (`/ sqrt(r)` with rsLoRA).
    pub lora_alpha: f64,
    /// Which modules get an adapter.
    pub target_modules: TargetModules,
    /// Modules left out even when `target_modules` selects them (names as
    /// in [`TargetModules::Names`], or a regex).
    pub exclude_modules: Option<TargetModules>,
    /// Dropout on each adapter's input while training.
    pub lora_dropout: f64,
    /// rsLoRA: the scaling is `lora_alpha / sqrt(r)`.
    pub use_rslora: bool,
    /// DoRA: a trainable magnitude per output row beside the adapter (Note [DoRA magnitudes]).
    pub use_dora: bool,
    /// Modules trained whole next to the adapters (a new head, say), saved
    /// in the adapter file under their own names.
    pub modules_to_save: Vec<String>,
    /// How fresh adapters are drawn.
    pub init_lora_weights: LoraInit,
    /// Per-module ranks, by a pattern matched at the end of the module's name
    /// (two patterns giving one module different ranks are an error).
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module `lora_alpha`, matched as `rank_pattern`.
    pub alpha_pattern: BTreeMap<String, f64>,
    /// The model the adapter was made for (informational).
    pub base_model_name_or_path: Option<String>,
    /// PEFT's task type (`"CAUSAL_LM"`).
    pub task_type: Option<String>,
}

impl LoraConfig {
    /// A configuration with PEFT's defaults (`lora_alpha = 8`, no dropout,
    /// the default initialisation) for rank `r` on `target_modules`.
    pub fn new(r: usize, target_modules: TargetModules) -> LoraConfig {
        LoraConfig {
            r,
            lora_alpha: 8.0,
            target_modules,
            exclude_modules: None,
            lora_dropout: 0.0,
            use_rslora: false,
            use_dora: false,
            modules_to_save: vec![],
            init_lora_weights: LoraInit::Default,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            base_model_name_or_path: None,
            task_type: Some("CAUSAL_LM".into()),
        }
    }

    /// The rank and scaling of the adapter on module `name`.
    pub fn rank_and_scaling(&self, name: &str) -> Result<(usize, f64)> {
        let r = match pattern_value(&self.rank_pattern, name)? {
            Some(r) => *r,
            None => self.r,
        };
        let alpha = match pattern_value(&self.alpha_pattern, name)? {
            Some(a) => *a,
            None => self.lora_alpha,
        };
        if r == 0 {
            return Err(Error::invalid("LoraConfig", format!("the rank of {name} is 0")));
        }
        let scaling = if self.use_rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 };
        Ok((r, scaling))
    }

    /// The selection rule with its regexes compiled once, given the names of
    /// the `Linear` layers' last components for `"all-linear"`
    /// (`all_linear_names`).
    pub(crate) fn selector(&self, all_linear_names: &[String]) -> Result<Selector> {
        let target = match &self.target_modules {
            TargetModules::AllLinear => Pattern::Names(all_linear_names.to_vec()),
            t => Pattern::new(t)?,
        };
        let exclude = match &self.exclude_modules {
            Some(TargetModules::AllLinear) => {
                return Err(Error::invalid("LoraConfig", "exclude_modules cannot be \"all-linear\""))
            }
            Some(e) => Some(Pattern::new(e)?),
            None => None,
        };
        Ok(Selector { target, exclude })
    }

    /// Whether module `name` is one of `modules_to_save` (PEFT's rule: the
    /// name, or a name ending in `.` and it).
    pub(crate) fn saves_module(&self, name: &str) -> bool {
        matches_names(&self.modules_to_save, name)
    }

    /// Reads PEFT's `adapter_config.json`. Fields kiln does not implement
    /// are refused unless they hold their inert value (`null`, `false`,
    /// `{}`, `[]`), and so are `bias` other than `"none"`,
    /// `fan_in_fan_out`, `layers_to_transform` and initialisations other
    /// than `true`, `false` and `"gaussian"`.
    pub fn from_json(v: &Value) -> Result<LoraConfig> {
        let err = |m: String| Error::invalid("adapter_config.json", m);
        let obj = v.as_object().ok_or_else(|| err("not a JSON object".into()))?;
        match obj.get("peft_type").and_then(Value::as_str) {
            Some("LORA") | None => {}
            Some(other) => return Err(err(format!("peft_type {other:?}: only LORA adapters are supported"))),
        }
        let r = obj.get("r").map_or(Some(8), Value::as_u64).ok_or_else(|| err("\"r\" is not a count".into()))?;
        let lora_alpha = obj.get("lora_alpha").map_or(Some(8.0), Value::as_f64);
        let lora_alpha = lora_alpha.ok_or_else(|| err("\"lora_alpha\" is not a number".into()))?;
        let lora_dropout = obj.get("lora_dropout").map_or(Some(0.0), Value::as_f64);
        let lora_dropout = lora_dropout.ok_or_else(|| err("\"lora_dropout\" is not a number".into()))?;
        let flag = |k: &str| -> Result<bool> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(other) => Err(err(format!("\"{k}\" is {other}, not a boolean"))),
            }
        };
        let target_modules = match obj.get("target_modules") {
            Some(Value::String(s)) if s == "all-linear" => TargetModules::AllLinear,
            Some(Value::String(s)) => TargetModules::Regex(s.clone()),
            Some(Value::Array(a)) => {
                TargetModules::Names(strings(a).ok_or_else(|| err("target_modules holds a non-string".into()))?)
            }
            _ => return Err(err("\"target_modules\" must be a list of names or a regex (string)".into())),
        };
        let exclude_modules = match obj.get("exclude_modules") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(TargetModules::Regex(s.clone())),
            Some(Value::Array(a)) => {
                Some(TargetModules::Names(strings(a).ok_or_else(|| err("exclude_modules holds a non-string".into()))?))
            }
            Some(other) => return Err(err(format!("\"exclude_modules\" is {other}"))),
        };
        let modules_to_save = match obj.get("modules_to_save") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => strings(a).ok_or_else(|| err("modules_to_save holds a non-string".into()))?,
            Some(other) => return Err(err(format!("\"modules_to_save\" is {other}, not a list"))),
        };
        let init_lora_weights = match obj.get("init_lora_weights") {
            None | Some(Value::Bool(true)) => LoraInit::Default,
            Some(Value::Bool(false)) => LoraInit::Random,
            Some(Value::String(s)) if s == "gaussian" => LoraInit::Gaussian,
            Some(other) => {
                return Err(err(format!("init_lora_weights {other} is not supported (true, false, \"gaussian\")")))
            }
        };
        let rank_pattern = pattern_map(obj.get("rank_pattern"), "rank_pattern", |v| v.as_u64().map(|r| r as usize))?;
        let alpha_pattern = pattern_map(obj.get("alpha_pattern"), "alpha_pattern", Value::as_f64)?;
        match obj.get("bias").and_then(Value::as_str) {
            None | Some("none") => {}
            Some(b) => return Err(err(format!("bias {b:?}: only \"none\" is supported"))),
        }
        for k in ["fan_in_fan_out", "lora_bias", "use_qalora", "use_bdlora"] {
            if flag(k)? {
                return Err(err(format!("\"{k}\": true is not supported")));
            }
        }
        let known = [
            "peft_type",
            "r",
            "lora_alpha",
            "lora_dropout",
            "target_modules",
            "exclude_modules",
            "modules_to_save",
            "init_lora_weights",
            "rank_pattern",
            "alpha_pattern",
            "bias",
            "use_rslora",
            "use_dora",
            "fan_in_fan_out",
            "lora_bias",
            "use_qalora",
            "use_bdlora",
            "base_model_name_or_path",
            "task_type",
            // Informational, or read only by features that are off.
            "peft_version",
            "revision",
            "inference_mode",
            "auto_mapping",
            "megatron_core",
            "qalora_group_size",
        ];
        for (k, v) in obj {
            let inert = match v {
                Value::Null | Value::Bool(false) => true,
                Value::Object(m) => m.is_empty(),
                Value::Array(a) => a.is_empty(),
                _ => false,
            };
            if !known.contains(&k.as_str()) && !inert {
                return Err(err(format!("\"{k}\" = {v} is not supported; kiln would otherwise ignore it")));
            }
        }
        let text = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_string);
        let c = LoraConfig {
            r: r as usize,
            lora_alpha,
            target_modules,
            exclude_modules,
            lora_dropout,
            use_rslora: flag("use_rslora")?,
            use_dora: flag("use_dora")?,
            modules_to_save,
            init_lora_weights,
            rank_pattern,
            alpha_pattern,
            base_model_name_or_path: text("base_model_name_or_path"),
            task_type: text("task_type"),
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the values: a rank of at least 1, a finite alpha, a dropout
    /// in `[0, 1)`, regexes that compile.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Error::invalid("LoraConfig", m);
        if self.r == 0 || self.rank_pattern.values().any(|&r| r == 0) {
            return Err(err("every rank must be at least 1".into()));
        }
        if !self.lora_alpha.is_finite() || self.alpha_pattern.values().any(|a| !a.is_finite()) {
            return Err(err("lora_alpha must be finite".into()));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(err(format!("lora_dropout must be in [0, 1), got {}", self.lora_dropout)));
        }
        for t in [Some(&self.target_modules), self.exclude_modules.as_ref()].into_iter().flatten() {
            if let TargetModules::Regex(re) = t {
                full_match_regex(re)?;
            }
        }
        for p in self.rank_pattern.keys().chain(self.alpha_pattern.keys()) {
            suffix_regex(p)?;
        }
        Ok(())
    }

    /// `adapter_config.json` as PEFT writes it (the fields PEFT reads back
    /// into the same configuration).
    pub fn to_json(&self) -> Value {
        let modules = |t: &TargetModules| match t {
            TargetModules::Names(n) => json!(n),
            TargetModules::Regex(r) => json!(r),
            TargetModules::AllLinear => json!("all-linear"),
        };
        let init = match self.init_lora_weights {
            LoraInit::Default => json!(true),
            LoraInit::Random => json!(false),
            LoraInit::Gaussian => json!("gaussian"),
        };
        json!({
            "peft_type": "LORA",
            "task_type": self.task_type,
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": modules(&self.target_modules),
            "exclude_modules": self.exclude_modules.as_ref().map(modules),
            "lora_dropout": self.lora_dropout,
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "fan_in_fan_out": false,
            "modules_to_save": if self.modules_to_save.is_empty() { Value::Null } else { json!(self.modules_to_save) },
            "init_lora_weights": init,
            "rank_pattern": self.rank_pattern,
            "alpha_pattern": self.alpha_pattern,
            "layers_to_transform": null,
            "layers_pattern": null,
            "inference_mode": true,
            "revision": null,
        })
    }
}

fn strings(a: &[Value]) -> Option<Vec<String>> {
    a.iter().map(|v| v.as_str().map(str::to_string)).collect()
}

fn pattern_map<T>(v: Option<&Value>, what: &str, read: impl Fn(&Value) -> Option<T>) -> Result<BTreeMap<String, T>> {
    let Some(m) = v.and_then(Value::as_object) else {
        return match v {
            None | Some(Value::Null) => Ok(BTreeMap::new()),
            Some(other) => Err(Error::invalid("adapter_config.json", format!("\"{what}\" is {other}, not an object"))),
        };
    };
    m.iter()
        .map(|(k, v)| {
            let x = read(v)
                .ok_or_else(|| Error::invalid("adapter_config.json", format!("{what}[{k:?}] = {v} is not a number")))?;
            Ok((k.clone(), x))
        })
        .collect()
}

/// PEFT's rule for a list of names: the name itself, or one ending in `.name`.
fn matches_names(names: &[String], key: &str) -> bool {
    names.iter().any(|t| key == t || key.ends_with(&format!(".{t}")))
}

/// `target_modules` or `exclude_modules` ready to match module names.
enum Pattern {
    Names(Vec<String>),
    Regex(regex::Regex),
}

impl Pattern {
    fn new(t: &TargetModules) -> Result<Pattern> {
        match t {
            TargetModules::Names(n) => Ok(Pattern::Names(n.clone())),
            TargetModules::Regex(re) => Ok(Pattern::Regex(full_match_regex(re)?)),
            TargetModules::AllLinear => Err(Error::invalid("LoraConfig", "\"all-linear\" is not a pattern")),
        }
    }

    fn matches(&self, key: &str) -> bool {
        match self {
            Pattern::Names(n) => matches_names(n, key),
            Pattern::Regex(re) => re.is_match(key),
        }
    }
}

/// Which modules a configuration selects ([`LoraConfig::selector`]).
pub(crate) struct Selector {
    target: Pattern,
    exclude: Option<Pattern>,
}

impl Selector {
    /// Whether module `name` gets an adapter: targeted and not excluded.
    pub(crate) fn selects(&self, name: &str) -> bool {
        self.target.matches(name) && !self.exclude.as_ref().is_some_and(|e| e.matches(name))
    }
}

fn full_match_regex(re: &str) -> Result<regex::Regex> {
    regex::Regex::new(&format!("^(?:{re})$"))
        .map_err(|e| Error::invalid("LoraConfig", format!("target regex {re:?} does not compile: {e}")))
}

/// A `rank_pattern` / `alpha_pattern` key matches a module whose name is
/// the key or ends with `.` and it (the key may be a regex).
fn suffix_regex(key: &str) -> Result<regex::Regex> {
    regex::Regex::new(&format!("^(?:.*\\.)?(?:{key})$"))
        .map_err(|e| Error::invalid("LoraConfig", format!("pattern {key:?} does not compile: {e}")))
}

/// The value of the pattern that matches `name`. PEFT takes the first match
/// in its file's order, which a JSON object does not keep: two patterns that
/// match one module with different values are an error rather than a guess.
fn pattern_value<'a, T: PartialEq>(patterns: &'a BTreeMap<String, T>, name: &str) -> Result<Option<&'a T>> {
    let mut found: Option<(&String, &T)> = None;
    for (k, v) in patterns {
        if suffix_regex(k)?.is_match(name) {
            match found {
                Some((k0, v0)) if v0 != v => {
                    return Err(Error::invalid(
                        "LoraConfig",
                        format!("the patterns {k0:?} and {k:?} both match {name} with different values"),
                    ))
                }
                Some(_) => {}
                None => found = Some((k, v)),
            }
        }
    }
    Ok(found.map(|(_, v)| v))
}
