//! `kiln-run DIR --inputs IN.safetensors --out OUT.safetensors [--device tpu:0]`:
//! runs a program written by `kiln::export` on the inputs `input.0`,
//! `input.1`, ... of a safetensors file and writes its outputs as `output.0`,
//! `output.1`, ...; no model code is involved (Note \[Export\]).
use kiln::nn::io::{load_safetensors, save_safetensors};
use kiln::{Device, Result, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

const USAGE: &str = "usage: kiln-run DIR --inputs IN.safetensors --out OUT.safetensors [--device tpu:0]";

fn run(args: &[String]) -> Result<()> {
    let bad = |m: &str| kiln::Error::invalid("kiln-run", format!("{m}\n{USAGE}"));
    let (mut dir, mut inputs, mut out, mut device) = (None, None, None, Device::Tpu(0));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(|| bad(&format!("{a} needs a value")));
        match a.as_str() {
            "--inputs" => inputs = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--device" => device = Device::parse(&value()?)?,
            s if s.starts_with("--") => return Err(bad(&format!("unknown option {s}"))),
            s => dir = Some(PathBuf::from(s)),
        }
    }
    let (dir, inputs, out) = match (dir, inputs, out) {
        (Some(d), Some(i), Some(o)) => (d, i, o),
        _ => return Err(bad("DIR, --inputs and --out are required")),
    };
    kiln::init_device(device)?;
    let mut program = kiln::export::load(&dir, device)?;
    let given = load_safetensors(&inputs)?;
    let xs = (0..program.inputs().len())
        .map(|i| {
            given
                .get(&format!("input.{i}"))
                .cloned()
                .ok_or_else(|| bad(&format!("{} has no input.{i}", inputs.display())))
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let outs = program.call(&xs)?;
    let mut m = BTreeMap::new();
    for (i, t) in outs.iter().enumerate() {
        m.insert(format!("output.{i}"), t.to_device(Device::Cpu)?.contiguous()?);
    }
    save_safetensors(&out, &m, None)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("kiln-run: {e}");
        std::process::exit(1);
    }
}
