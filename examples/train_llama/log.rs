//! train_llama's loss log (`loss.csv`) and its plot (`loss.png`).
use kiln::prelude::*;
use std::path::Path;

/// One row of `loss.csv`.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_sec: f64,
    pub val_loss: Option<f64>,
    pub accuracy: Option<f64>,
}

const CSV_HEADER: &str = "step,loss,lr,grad_norm,tokens_per_sec,val_loss,accuracy";

impl Row {
    fn csv(&self) -> String {
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.6}"));
        format!(
            "{},{:.6},{:.6e},{:.4},{:.1},{},{}",
            self.step,
            self.loss,
            self.lr,
            self.grad_norm,
            self.tokens_per_sec,
            opt(self.val_loss),
            opt(self.accuracy)
        )
    }
    fn parse(line: &str) -> Option<Row> {
        let f: Vec<&str> = line.split(',').collect();
        let opt = |s: &str| if s.is_empty() { None } else { s.parse().ok() };
        Some(Row {
            step: f.first()?.parse().ok()?,
            loss: f.get(1)?.parse().ok()?,
            lr: f.get(2)?.parse().ok()?,
            grad_norm: f.get(3)?.parse().ok()?,
            tokens_per_sec: f.get(4)?.parse().ok()?,
            val_loss: opt(f.get(5)?),
            accuracy: opt(f.get(6)?),
        })
    }
}

pub fn read_log(path: &Path, up_to_step: u64) -> Vec<Row> {
    let Ok(text) = std::fs::read_to_string(path) else { return vec![] };
    text.lines().skip(1).filter_map(Row::parse).filter(|r| r.step <= up_to_step).collect()
}

pub fn write_log(path: &Path, rows: &[Row]) -> Result<()> {
    let mut text = String::from(CSV_HEADER);
    text.push('\n');
    for r in rows {
        text.push_str(&r.csv());
        text.push('\n');
    }
    kiln::nn::io::write_atomic(path, |w| w.write_all(text.as_bytes()))
}

/// Draws text with the 8x8 bitmap font, `scale` pixels per font pixel.
fn draw_text<DB: plotters::prelude::DrawingBackend>(
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    text: &str,
    (x, y): (i32, i32),
    scale: i32,
    color: &plotters::prelude::RGBColor,
) {
    for (i, ch) in text.chars().enumerate() {
        let glyph = font8x8::legacy::BASIC_LEGACY.get(ch as usize).copied().unwrap_or([0; 8]);
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits >> col & 1 == 1 {
                    let (px, py) = (x + (i as i32 * 8 + col) * scale, y + row as i32 * scale);
                    for d in 0..scale * scale {
                        let _ = area.draw_pixel((px + d % scale, py + d / scale), color);
                    }
                }
            }
        }
    }
}

/// "Nice" tick values covering `lo..hi`.
fn ticks(lo: f64, hi: f64, want: usize) -> Vec<f64> {
    let raw = (hi - lo) / want.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = vec![];
    while t <= hi + 1e-9 * step {
        out.push(t);
        t += step;
    }
    out
}

/// `loss.png`: training loss per step (light), its moving average, and the validation loss.
pub fn plot(path: &Path, rows: &[Row], title: &str) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    if rows.is_empty() {
        return Ok(());
    }
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let x_max = rows.last().map_or(1, |r| r.step).max(1) as f64;
    let y_max = rows.iter().map(|r| r.loss).chain(rows.iter().filter_map(|r| r.val_loss)).fold(0.0, f64::max) * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .margin_top(50)
        .margin_left(70)
        .margin_bottom(50)
        .margin_right(45)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max.max(1e-3))?;
    let grid = RGBColor(225, 225, 225);
    let axis = RGBColor(90, 90, 90);
    for y in ticks(0.0, y_max, 6) {
        chart.draw_series(LineSeries::new([(0.0, y), (x_max, y)], grid))?;
        let (px, py) = chart.backend_coord(&(0.0, y));
        let label = format!("{y:.1}");
        draw_text(&root, &label, (px - 10 - 8 * label.len() as i32, py - 4), 1, &axis);
    }
    for x in ticks(0.0, x_max, 8) {
        chart.draw_series(LineSeries::new([(x, 0.0), (x, y_max)], grid))?;
        let (px, py) = chart.backend_coord(&(x, 0.0));
        let label = format!("{x:.0}");
        draw_text(&root, &label, (px - 4 * label.len() as i32, py + 10), 1, &axis);
    }
    chart.draw_series(LineSeries::new([(0.0, 0.0), (x_max, 0.0)], axis))?;
    chart.draw_series(LineSeries::new([(0.0, 0.0), (0.0, y_max)], axis))?;
    let light = RGBColor(160, 190, 235);
    chart.draw_series(LineSeries::new(rows.iter().map(|r| (r.step as f64, r.loss)), light))?;
    // Exponential moving average with Adam's bias correction (no lag at the start).
    let mut ema = 0.0;
    let smooth: Vec<(f64, f64)> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            ema = 0.95 * ema + 0.05 * r.loss;
            (r.step as f64, ema / (1.0 - 0.95f64.powi(i as i32 + 1)))
        })
        .collect();
    let blue = RGBColor(30, 80, 200);
    chart.draw_series(LineSeries::new(smooth, blue.stroke_width(2)))?;
    let red = RGBColor(220, 50, 40);
    let val: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.val_loss.map(|v| (r.step as f64, v))).collect();
    chart.draw_series(LineSeries::new(val.clone(), red.stroke_width(2)))?;
    chart.draw_series(val.iter().map(|&p| Circle::new(p, 4, red.filled())))?;
    // Held-out accuracy (addition), on a 0..100% axis at the right.
    let acc: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.accuracy.map(|a| (r.step as f64, a * y_max))).collect();
    let green = RGBColor(20, 150, 60);
    if !acc.is_empty() {
        chart.draw_series(LineSeries::new(acc.clone(), green.stroke_width(2)))?;
        chart.draw_series(acc.iter().map(|&p| Circle::new(p, 4, green.filled())))?;
        for pct in [0, 25, 50, 75, 100] {
            let (px, py) = chart.backend_coord(&(x_max, pct as f64 / 100.0 * y_max));
            draw_text(&root, &format!("{pct}%"), (px + 6, py - 4), 1, &green);
        }
        draw_text(&root, "held-out accuracy", (660, 102), 1, &green);
    }
    draw_text(&root, title, (70, 12), 2, &BLACK);
    draw_text(&root, "step", (450, 520), 1, &axis);
    draw_text(&root, "loss (nats/token)", (10, 36), 1, &axis);
    draw_text(&root, "train", (660, 60), 1, &light);
    draw_text(&root, "train (moving average)", (660, 74), 1, &blue);
    draw_text(&root, "validation", (660, 88), 1, &red);
    root.present()?;
    Ok(())
}
