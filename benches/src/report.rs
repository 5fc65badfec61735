//! Output: one JSON object per line on stdout, so scripts (`compare_torch.py`,
//! CI logs, `jq`) read results without parsing prose.
use serde_json::{json, Map, Value};
use std::io::Write;

/// One result line under construction. Every line carries `bench`, `dtype` and
/// `device`; the rest depends on the benchmark.
pub struct Line(Map<String, Value>);

impl Line {
    pub fn new(bench: &str, dtype: &str, device: &str) -> Line {
        let mut m = Map::new();
        m.insert("bench".into(), json!(bench));
        m.insert("dtype".into(), json!(dtype));
        m.insert("device".into(), json!(device));
        Line(m)
    }
    pub fn set(mut self, key: &str, v: impl Into<Value>) -> Line {
        self.0.insert(key.into(), v.into());
        self
    }
    /// Whether the line has `key`.
    pub fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }
    /// A value set on the line.
    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }
    /// Prints the line and flushes, so a reader sees each result as it is measured.
    pub fn emit(self) {
        let mut out = std::io::stdout().lock();
        // A closed pipe (`kiln-bench ops | head -1`) is not an error worth a panic.
        let _ = writeln!(out, "{}", Value::Object(self.0));
        let _ = out.flush();
    }
}

/// Rounds to 4 significant digits: enough for a benchmark, short to read.
pub fn sig4(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let p = 10f64.powi(3 - x.abs().log10().floor() as i32);
    (x * p).round() / p
}

#[cfg(test)]
mod tests {
    use super::sig4;

    #[test]
    fn four_significant_digits() {
        assert_eq!(sig4(123456.0), 123500.0);
        assert_eq!(sig4(0.00123456), 0.001235);
        assert_eq!(sig4(0.0), 0.0);
    }
}
