//! kiln-bench: kiln's benchmarks, printed as one JSON object per line.
fn main() {
    kiln::init();
    eprintln!("usage: kiln-bench <matmul|ops> [options]");
}
