//! kiln's `tracing` events reach a subscriber: the PJRT plugin loading, compiles
//! (with their times), compile-cache evictions, traces of a `kiln::compile`
//! function and its retraces with the reason; and the examples' default
//! subscriber (`kiln::logging::filter_directives`) shows retraces when
//! `KILN_LOG_RETRACES=1` and leaves out what that variable did not print.
//!
//! The test runs in a child process given its environment (a fresh compile
//! cache capped at 0 MB, the `KILN_LOG_*` variables), in a binary of its own:
//! the PJRT backend registers inside the subscriber's scope.
mod common;

use kiln::prelude::*;
use std::sync::{Arc, Mutex};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::{fmt, EnvFilter, Registry};

/// One event as the collector saw it.
#[derive(Debug, Clone)]
struct Seen {
    target: String,
    level: Level,
    message: String,
    fields: Vec<(String, String)>,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// A layer that records every event.
struct Collector(Arc<Mutex<Vec<Seen>>>);

struct Fields<'a>(&'a mut Seen);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let v = format!("{value:?}");
        if field.name() == "message" {
            self.0.message = v;
        } else {
            self.0.fields.push((field.name().to_string(), v));
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.message = value.to_string();
        } else {
            self.0.fields.push((field.name().to_string(), value.to_string()));
        }
    }
}

impl<S: Subscriber> Layer<S> for Collector {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let m = event.metadata();
        let mut seen =
            Seen { target: m.target().to_string(), level: *m.level(), message: String::new(), fields: vec![] };
        event.record(&mut Fields(&mut seen));
        self.0.lock().unwrap().push(seen);
    }
}

thread_local! {
    /// The line of the compile call the warning must name.
    static SITE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// What the examples' fmt subscriber writes, kept in memory.
#[derive(Clone, Default)]
struct Printed(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Printed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs the test below in a child process with its environment: a fresh
/// compile cache capped at 0 MB, retraces logged, nothing else asked for.
#[test]
fn a_subscriber_receives_plugin_compile_and_retrace_events() {
    let cache = std::env::temp_dir().join(format!("kiln-tracing-events-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    common::run_ignored_test_in_child(
        "events_in_a_fresh_cache",
        &[
            ("KILN_CACHE_DIR", cache.as_os_str()),
            ("KILN_CACHE_MAX_MB", "0".as_ref()),
            ("KILN_LOG_RETRACES", "1".as_ref()),
        ],
        &["RUST_LOG", "KILN_LOG_COMPILES"],
    );
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
#[ignore = "a child process of a_subscriber_receives_plugin_compile_and_retrace_events"]
fn events_in_a_fresh_cache() {
    let cache = std::path::PathBuf::from(std::env::var_os("KILN_CACHE_DIR").expect("run by its parent test"));
    let directives = kiln::logging::filter_directives();
    assert_eq!(directives, "warn,kiln::retrace=debug");

    let seen = Arc::new(Mutex::new(vec![]));
    let printed = Printed::default();
    let writer = printed.clone();
    let subscriber = Registry::default().with(Collector(seen.clone())).with(
        fmt::layer().with_ansi(false).with_writer(move || writer.clone()).with_filter(EnvFilter::new(&directives)),
    );
    tracing::subscriber::with_default(subscriber, || {
        common::devices();
        let dev = Device::Tpu(0);
        let mut f = kiln::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(&xs[0])?.add(&xs[0])?]));
        let x3 = Tensor::new([1f32, 2., 3.]).unwrap().to_device(dev).unwrap();
        for _ in 0..3 {
            assert_eq!(f.call(std::slice::from_ref(&x3)).unwrap()[0].to_vec::<f32>().unwrap(), [2., 6., 12.]);
        }
        assert_eq!(f.stats().replays, 1);
        let x4 = Tensor::new([1f32, 2., 3., 4.]).unwrap().to_device(dev).unwrap();
        assert_eq!(f.call(&[x4]).unwrap()[0].to_vec::<f32>().unwrap(), [2., 6., 12., 20.]);
        assert_eq!(f.stats().retraces, 1);

        // A function that reads a host value of its own code is never replayed, and says so.
        let mut g = kiln::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(2.0)?]));
        assert_eq!(g.call(std::slice::from_ref(&x3)).unwrap()[0].to_vec::<f32>().unwrap(), [2., 4., 6.]);

        // One that keeps tracing for that reason warns once, naming the value and where it was compiled.
        let site = line!() + 1;
        let mut d = kiln::compile(Device::Cpu, |xs: &[Tensor]| Ok(vec![xs[0].dropout(0.5, true)?]));
        let ones = Tensor::ones(&[8], DType::F32).unwrap();
        for _ in 0..8 {
            d.call(std::slice::from_ref(&ones)).unwrap();
        }
        let s = d.stats();
        assert_eq!((s.traces, s.replays, s.host_value_traces), (8, 0, 8), "{s:?}");
        SITE.with(|c| c.set(site));
    });
    let seen = seen.lock().unwrap().clone();
    let find = |target: &str, level: Level, message: &str| -> Vec<Seen> {
        seen.iter()
            .filter(|e| e.target == target && e.level == level && e.message.starts_with(message))
            .cloned()
            .collect()
    };

    let plugin = find("kiln::pjrt", Level::INFO, "loaded the PJRT plugin");
    assert_eq!(plugin.len(), 1, "{seen:#?}");
    assert!(plugin[0].field("plugin").is_some_and(|p| p.contains("pjrt")), "{:?}", plugin[0]);
    assert!(plugin[0].field("devices").is_some_and(|d| d.parse::<usize>().unwrap() >= 1));

    let compiled = find("kiln::compile", Level::DEBUG, "compiled a program");
    assert!(!compiled.is_empty(), "a fresh cache compiles: {seen:#?}");
    assert!(compiled.iter().all(|e| e.field("ms").is_some_and(|ms| ms.parse::<f64>().unwrap() >= 0.0)));
    assert!(!find("kiln::compile", Level::TRACE, "executable cache hit").is_empty(), "replays hit the cache");
    let evicted = find("kiln::compile", Level::DEBUG, "evicted");
    assert!(!evicted.is_empty(), "a 0 MB cache evicts what it stores");
    assert!(evicted.iter().all(|e| e.field("path").is_some_and(|p| p.ends_with(".kxe"))));
    assert_eq!(std::fs::read_dir(&cache).map_or(0, |d| d.filter(|e| e.is_ok()).count()), 0);

    let traced = find("kiln::compile", Level::DEBUG, "traced the captured function");
    assert_eq!(traced.len(), 12, "f: two traces of [3] (the second confirms the first), one of [4]; g: one; d: 8");
    let retraces = find("kiln::retrace", Level::INFO, "retracing");
    assert_eq!(retraces.len(), 1, "{seen:#?}");
    let reason = retraces[0].field("reason").unwrap();
    assert!(reason.contains("input 0 changed") && reason.contains("[3]") && reason.contains("[4]"), "{reason}");

    let host = find("kiln::retrace", Level::INFO, "the trace reads host values");
    assert_eq!(host.len(), 9, "g once, d on each of its 8 calls: {seen:#?}");
    assert!(host[0].message.contains("kiln::constant"), "{:?}", host[0]);
    let warned = find("kiln::retrace", Level::WARN, "the function compiled at");
    assert_eq!(warned.len(), 1, "one warning, for d: {seen:#?}");
    let at = format!("tests/tracing_events.rs:{}", SITE.with(|c| c.get()));
    let w = &warned[0];
    assert!(w.field("compiled_at").is_some_and(|s| s.contains(&at)), "{w:?} should name {at}");
    assert!(w.field("host_value").is_some_and(|v| v.contains("host scalar")), "{w:?}");
    assert!(
        w.message.contains("every call") && w.message.contains("kiln::constant") && w.message.contains("HostScalar")
    );

    // The examples' subscriber with KILN_LOG_RETRACES=1 prints the retrace and
    // not the compiles, as the variable did before.
    let text = String::from_utf8(printed.0.lock().unwrap().clone()).unwrap();
    assert!(text.contains("retracing") && text.contains("input 0 changed"), "{text}");
    assert!(text.contains("is traced on every call and never replayed"), "warnings print by default: {text}");
    assert!(!text.contains("compiled a program") && !text.contains("loaded the PJRT plugin"), "{text}");
    let _ = std::fs::remove_dir_all(&cache);
}
