//! Composites against PyTorch: softmax/log_softmax (including infinities, NaN
//! and half precision), cumsum, tril/triu, sort/argsort/topk, embedding,
//! rms_norm, layer_norm, dropout and cross_entropy. Expected values come from
//! PyTorch 2.x.
mod common;

use common::*;
use kiln::prelude::*;

const INF: f64 = f64::INFINITY;
const NAN: f64 = f64::NAN;

fn x34() -> Tensor {
    Tensor::new([[1.0f32, 2.0, 3.0, 0.5], [-1.0, 0.0, 4.0, 2.0], [0.25, -3.0, 1.5, 1.0]]).unwrap()
}

// ---- softmax, log_softmax -----------------------------------------------------------------

#[test]
fn softmax_values() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        let sm1 = [
            0.08536889404058456,
            0.23205672204494476,
            0.6307955384254456,
            0.051778849214315414,
            0.005806627683341503,
            0.01578405126929283,
            0.8617799878120422,
            0.1166292354464531,
            0.1504637897014618,
            0.00583411380648613,
            0.5251702070236206,
            0.3185318410396576,
        ];
        assert_close(&x.softmax(1)?, DType::F32, &[3, 4], &sm1, 1e-6);
        assert_close(&x.softmax(-1)?, DType::F32, &[3, 4], &sm1, 1e-6);
        assert_close(
            &x.softmax(0)?,
            DType::F32,
            &[3, 4],
            &[
                0.6220058798789978,
                0.8756005764007568,
                0.25371620059013367,
                0.14024437963962555,
                0.0841793343424797,
                0.11849965155124664,
                0.6896721124649048,
                0.6285316944122314,
                0.2938147485256195,
                0.0058997501619160175,
                0.05661173537373543,
                0.23122389614582062,
            ],
            1e-6,
        );
        // Non-contiguous input: softmax over dim 0 of the transpose is softmax over dim 1.
        assert_close(&x.t()?.softmax(0)?.t()?.contiguous()?, DType::F32, &[3, 4], &sm1, 1e-6);
        // A 0-d tensor gives 1.
        assert_exact(&Tensor::scalar(3.0, DType::F32)?.softmax(0)?, DType::F32, &[], &[1.0]);
        assert_exact(&Tensor::scalar(3.0, DType::F32)?.log_softmax(-1)?, DType::F32, &[], &[0.0]);
        assert_err(Tensor::new([1i64, 2])?.softmax(0), &["softmax", "int64"]);
        assert_err(x.softmax(2), &["dimension out of range"]);
        Ok(())
    })
}

#[test]
fn log_softmax_values() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_close(
            &x.log_softmax(-1)?,
            DType::F32,
            &[3, 4],
            &[
                -2.460773468017578,
                -1.4607734680175781,
                -0.4607734978199005,
                -2.960773468017578,
                -5.148755073547363,
                -4.148755073547363,
                -0.1487552523612976,
                -2.1487553119659424,
                -1.8940328359603882,
                -5.144032955169678,
                -0.6440328359603882,
                -1.1440328359603882,
            ],
            1e-6,
        );
        assert_close(
            &x.log_softmax(0)?,
            DType::F32,
            &[3, 4],
            &[
                -0.4748057723045349,
                -0.13284526765346527,
                -1.3715389966964722,
                -1.9643688201904297,
                -2.4748058319091797,
                -2.132845163345337,
                -0.37153899669647217,
                -0.4643687903881073,
                -1.2248058319091797,
                -5.132845401763916,
                -2.8715391159057617,
                -1.4643688201904297,
            ],
            1e-6,
        );
        Ok(())
    })
}

#[test]
fn softmax_infinities_nan_and_large_values() -> Result<()> {
    common::on_every_device(|| {
        let s = Tensor::new([
            [1.0f32, f32::INFINITY, 2.0],
            [f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY],
            [f32::NEG_INFINITY, 1.0, 2.0],
            [f32::NAN, 1.0, 2.0],
            [1000.0, 1001.0, 1002.0],
        ])?;
        assert_close(
            &s.softmax(1)?,
            DType::F32,
            &[5, 3],
            &[
                NAN,
                NAN,
                NAN,
                NAN,
                NAN,
                NAN,
                0.0,
                0.2689414322376251,
                0.7310585975646973,
                NAN,
                NAN,
                NAN,
                0.09003057330846786,
                0.2447284758090973,
                0.6652409434318542,
            ],
            1e-6,
        );
        assert_close(
            &s.log_softmax(1)?,
            DType::F32,
            &[5, 3],
            &[
                NAN,
                NAN,
                NAN,
                NAN,
                NAN,
                NAN,
                -INF,
                -1.31326162815094,
                -0.31326165795326233,
                NAN,
                NAN,
                NAN,
                -2.4076058864593506,
                -1.4076058864593506,
                -0.40760594606399536,
            ],
            1e-6,
        );
        Ok(())
    })
}

#[test]
fn softmax_half_precision_computes_in_f32() -> Result<()> {
    common::on_every_device(|| {
        let xb = x34().to_dtype(DType::BF16)?;
        let sm = xb.softmax(1)?;
        assert_exact(
            &sm,
            DType::BF16,
            &[3, 4],
            &[
                0.08544921875,
                0.232421875,
                0.62890625,
                0.0517578125,
                0.00579833984375,
                0.0157470703125,
                0.86328125,
                0.11669921875,
                0.150390625,
                0.005828857421875,
                0.5234375,
                0.318359375,
            ],
        );
        assert_close(
            &xb.log_softmax(1)?,
            DType::BF16,
            &[3, 4],
            &[
                -2.46875,
                -1.4609375,
                -0.4609375,
                -2.96875,
                -5.15625,
                -4.15625,
                -0.15234375,
                -2.15625,
                -1.890625,
                -5.15625,
                -0.64453125,
                -1.140625,
            ],
            8e-3,
        );
        let h = x34().to_dtype(DType::F16)?.softmax(0)?;
        assert_eq!(h.dtype(), DType::F16);
        Ok(())
    })
}

// ---- cumsum --------------------------------------------------------------------------------

#[test]
fn cumsum() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::new([[1.5f32, 2.0, -1.0], [0.0, 3.0, 4.0]])?;
        assert_exact(&x.cumsum(1)?, DType::F32, &[2, 3], &[1.5, 3.5, 2.5, 0.0, 3.0, 7.0]);
        assert_exact(&x.cumsum(-2)?, DType::F32, &[2, 3], &[1.5, 2.0, -1.0, 1.5, 5.0, 3.0]);
        assert_exact(&x.t()?.cumsum(0)?, DType::F32, &[3, 2], &[1.5, 0.0, 3.5, 3.0, 2.5, 7.0]);
        assert_exact(&Tensor::new([true, false, true])?.cumsum(0)?, DType::I64, &[3], &[1.0, 1.0, 2.0]);
        assert_exact(&Tensor::new([100u8, 200, 250])?.cumsum(0)?, DType::I64, &[3], &[100.0, 300.0, 550.0]);
        assert_exact(&Tensor::scalar(2.0, DType::F32)?.cumsum(0)?, DType::F32, &[], &[2.0]);
        assert_err(x.cumsum(2), &["dimension out of range"]);
        Ok(())
    })
}

// ---- tril, triu --------------------------------------------------------------------------

#[test]
fn tril_triu() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::arange(1.0, 13.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
        assert_exact(&x.tril(0)?, DType::F32, &[3, 4], &[1.0, 0.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 9.0, 10.0, 11.0, 0.0]);
        assert_exact(
            &x.tril(1)?,
            DType::F32,
            &[3, 4],
            &[1.0, 2.0, 0.0, 0.0, 5.0, 6.0, 7.0, 0.0, 9.0, 10.0, 11.0, 12.0],
        );
        assert_exact(&x.tril(-1)?, DType::F32, &[3, 4], &[0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 9.0, 10.0, 0.0, 0.0]);
        assert_exact(&x.triu(0)?, DType::F32, &[3, 4], &[1.0, 2.0, 3.0, 4.0, 0.0, 6.0, 7.0, 8.0, 0.0, 0.0, 11.0, 12.0]);
        assert_exact(&x.triu(2)?, DType::F32, &[3, 4], &[0.0, 0.0, 3.0, 4.0, 0.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0]);
        assert_exact(
            &x.triu(-1)?,
            DType::F32,
            &[3, 4],
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 0.0, 10.0, 11.0, 12.0],
        );
        // Batches: the last two dims.
        let b = Tensor::ones(&[2, 2, 2], DType::I64)?;
        assert_exact(&b.tril(0)?, DType::I64, &[2, 2, 2], &[1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
        // The dtype is kept (bool causal masks).
        let m = Tensor::ones(&[3, 3], DType::Bool)?.tril(0)?;
        assert_exact(&m, DType::Bool, &[3, 3], &[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]);
        // In place, through a view.
        let base = Tensor::ones(&[2, 3, 3], DType::F32)?;
        base.i(1)?.triu_(1)?;
        assert_exact(&base.i(1)?, DType::F32, &[3, 3], &[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
        assert_exact(&base.i(0)?, DType::F32, &[3, 3], &[1.0; 9]);
        base.i(0)?.tril_(-2)?;
        assert_exact(&base.i(0)?, DType::F32, &[3, 3], &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        assert_err(Tensor::zeros(&[3], DType::F32)?.tril(0), &["tril: input tensor must have at least 2 dimensions"]);
        Ok(())
    })
}

// ---- sort, argsort, topk -------------------------------------------------------------------

#[test]
fn sort_and_argsort() -> Result<()> {
    common::on_every_device(|| {
        let t = Tensor::new([3.0f32, 1.0, 2.0, 1.0, f32::NAN, 0.0])?;
        // NaN sorts as the largest value.
        let (v, _) = t.sort(0, false)?;
        assert_exact(&v, DType::F32, &[6], &[0.0, 1.0, 1.0, 2.0, 3.0, NAN]);
        let (v, _) = t.sort(-1, true)?;
        assert_exact(&v, DType::F32, &[6], &[NAN, 3.0, 2.0, 1.0, 1.0, 0.0]);
        let (v, i) = t.sort_stable(0, false)?;
        assert_exact(&v, DType::F32, &[6], &[0.0, 1.0, 1.0, 2.0, 3.0, NAN]);
        assert_exact(&i, DType::I64, &[6], &[5.0, 1.0, 3.0, 2.0, 0.0, 4.0]);
        let (_, i) = t.sort_stable(0, true)?;
        assert_exact(&i, DType::I64, &[6], &[4.0, 0.0, 2.0, 1.0, 3.0, 5.0]);
        let m = Tensor::new([[3i64, 1, 2], [9, 7, 8]])?;
        let (v, i) = m.sort(0, true)?;
        assert_exact(&v, DType::I64, &[2, 3], &[9.0, 7.0, 8.0, 3.0, 1.0, 2.0]);
        assert_exact(&i, DType::I64, &[2, 3], &[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        assert_exact(&m.argsort(1, false)?, DType::I64, &[2, 3], &[1.0, 2.0, 0.0, 1.0, 2.0, 0.0]);
        let (v, i) = Tensor::scalar(4.0, DType::F32)?.sort(0, false)?;
        assert_exact(&v, DType::F32, &[], &[4.0]);
        assert_exact(&i, DType::I64, &[], &[0.0]);
        Ok(())
    })
}

#[test]
fn topk() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::new([[1.0f32, 5.0, 3.0, 4.0], [8.0, 2.0, 6.0, 7.0]])?;
        let (v, i) = x.topk(2, 1, true, true)?;
        assert_exact(&v, DType::F32, &[2, 2], &[5.0, 4.0, 8.0, 7.0]);
        assert_exact(&i, DType::I64, &[2, 2], &[1.0, 3.0, 0.0, 3.0]);
        let (v, i) = x.topk(3, -1, false, true)?;
        assert_exact(&v, DType::F32, &[2, 3], &[1.0, 3.0, 4.0, 2.0, 6.0, 7.0]);
        assert_exact(&i, DType::I64, &[2, 3], &[0.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        let (v, i) = x.topk(1, 0, true, false)?;
        assert_exact(&v, DType::F32, &[1, 4], &[8.0, 5.0, 6.0, 7.0]);
        assert_exact(&i, DType::I64, &[1, 4], &[1.0, 0.0, 1.0, 1.0]);
        let (v, _) = x.topk(0, 1, true, true)?;
        assert_eq!(v.shape(), &[2, 0]);
        assert_err(x.topk(5, 1, true, true), &["topk", "out of range"]);
        Ok(())
    })
}

// ---- embedding -----------------------------------------------------------------------------

#[test]
fn embedding() -> Result<()> {
    common::on_every_device(|| {
        let w = Tensor::arange(0.0, 8.0, 1.0, DType::F32)?.reshape(&[4, 2])?;
        let ids = Tensor::new([[3i64, 0, 3], [1, 1, 2]])?;
        let e = Tensor::embedding(&w, &ids)?;
        assert_exact(&e, DType::F32, &[2, 3, 2], &[6.0, 7.0, 0.0, 1.0, 6.0, 7.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(!e.is_view());
        assert_exact(&Tensor::embedding(&w, &Tensor::scalar(2, DType::I64)?)?, DType::F32, &[2], &[4.0, 5.0]);
        assert_exact(&Tensor::embedding(&w, &Tensor::new([1i32])?)?, DType::F32, &[1, 2], &[2.0, 3.0]);
        assert_err(Tensor::embedding(&w, &Tensor::new([1.0f32])?), &["embedding", "float32"]);
        assert_err(Tensor::embedding(&w.reshape(&[8])?, &ids), &["embedding", "'weight' must be 2-D"]);
        assert!(Tensor::embedding(&w, &Tensor::new([4i64])?).is_err());
        Ok(())
    })
}

// ---- rms_norm, layer_norm -----------------------------------------------------------------

#[test]
fn rms_norm() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]])?;
        assert_close(
            &x.rms_norm(None, 1e-6)?,
            DType::F32,
            &[2, 3],
            &[
                0.462909996509552,
                0.925819993019104,
                1.3887300491333008,
                0.7895419597625732,
                0.9869274497032166,
                1.1843129396438599,
            ],
            1e-6,
        );
        let g = Tensor::new([0.5f32, 1.0, 2.0])?;
        assert_close(
            &x.rms_norm(Some(&g), 1e-6)?,
            DType::F32,
            &[2, 3],
            &[
                0.231454998254776,
                0.925819993019104,
                2.7774600982666016,
                0.3947709798812866,
                0.9869274497032166,
                2.3686258792877197,
            ],
            1e-6,
        );
        let xb = x.to_dtype(DType::BF16)?;
        let y = xb.rms_norm(Some(&g.to_dtype(DType::BF16)?), 1e-6)?;
        assert_close(
            &y,
            DType::BF16,
            &[2, 3],
            &[0.2314453125, 0.92578125, 2.78125, 0.39453125, 0.98828125, 2.375],
            8e-3,
        );
        // A 2-D weight normalises over the last two dims.
        let w2 = Tensor::ones(&[2, 3], DType::F32)?;
        let whole = x.rms_norm(Some(&w2), 0.0)?;
        let ms: f64 = (1..=6).map(|v| (v * v) as f64).sum::<f64>() / 6.0;
        assert_close(&whole, DType::F32, &[2, 3], &(1..=6).map(|v| v as f64 / ms.sqrt()).collect::<Vec<_>>(), 1e-6);
        assert_err(x.rms_norm(Some(&Tensor::ones(&[4], DType::F32)?), 1e-6), &["rms_norm", "[4]"]);
        assert_err(Tensor::new([1i64])?.rms_norm(None, 1e-6), &["rms_norm", "int64"]);
        Ok(())
    })
}

#[test]
fn layer_norm() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]])?;
        assert_close(
            &x.layer_norm(&[3], None, None, 1e-5)?,
            DType::F32,
            &[2, 3],
            &[-1.2247356176376343, 0.0, 1.2247356176376343, -1.2247356176376343, 0.0, 1.2247356176376343],
            1e-6,
        );
        let g = Tensor::new([0.5f32, 1.0, 2.0])?;
        let b = Tensor::new([0.0f32, 1.0, -1.0])?;
        assert_close(
            &x.layer_norm(&[3], Some(&g), Some(&b), 1e-5)?,
            DType::F32,
            &[2, 3],
            &[-0.6123678088188171, 1.0, 1.4494712352752686, -0.6123678088188171, 1.0, 1.4494712352752686],
            1e-6,
        );
        let sq = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[2, 2, 3])?.square()?;
        assert_close(
            &sq.layer_norm(&[2, 3], None, None, 1e-5)?,
            DType::F32,
            &[2, 2, 3],
            &[
                -1.0304251909255981,
                -0.91801518201828,
                -0.5807850956916809,
                -0.018735038116574287,
                0.7681350708007812,
                1.779825210571289,
                -1.3440864086151123,
                -0.8979640603065491,
                -0.3832075595855713,
                0.2001831829547882,
                0.852208137512207,
                1.5728672742843628,
            ],
            1e-5,
        );
        let xb = x.to_dtype(DType::BF16)?;
        assert_close(
            &xb.layer_norm(&[3], None, None, 1e-5)?,
            DType::BF16,
            &[2, 3],
            &[-1.2265625, 0.0, 1.2265625, -1.2265625, 0.0, 1.2265625],
            8e-3,
        );
        assert_err(
            x.layer_norm(&[4], None, None, 1e-5),
            &["Given normalized_shape=[4], expected input with shape [*, 4], but got input of size[2, 3]"],
        );
        assert_err(
            x.layer_norm(&[3], Some(&Tensor::ones(&[2], DType::F32)?), None, 1e-5),
            &["Expected weight to be of same shape as normalized_shape"],
        );
        Ok(())
    })
}

// ---- dropout --------------------------------------------------------------------------------

#[test]
fn dropout() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::ones(&[10_000], DType::F32)?;
        assert!(x.dropout(0.3, false)?.same(&x));
        assert!(x.dropout(0.0, true)?.same(&x));
        kiln::manual_seed(7);
        let y = x.dropout(0.25, true)?;
        let v = y.to_vec::<f32>()?;
        let scale = 1.0 / 0.75f32;
        assert!(v.iter().all(|&e| e == 0.0 || e == scale));
        let dropped = v.iter().filter(|&&e| e == 0.0).count() as f64 / v.len() as f64;
        assert!((dropped - 0.25).abs() < 0.03, "dropped fraction {dropped}");
        // Reproducible with the same seed.
        kiln::manual_seed(7);
        assert_eq!(x.dropout(0.25, true)?.to_vec::<f32>()?, v);
        // p = 1 zeroes everything (NaN stays NaN, as PyTorch multiplies by zero).
        let n = Tensor::new([1.0f32, f32::NAN])?;
        assert_exact(&n.dropout(1.0, true)?, DType::F32, &[2], &[0.0, NAN]);
        // Half precision keeps its dtype.
        assert_eq!(x.to_dtype(DType::BF16)?.dropout(0.5, true)?.dtype(), DType::BF16);
        assert_err(x.dropout(1.5, true), &["dropout probability has to be between 0 and 1, but got 1.5"]);
        assert_err(Tensor::new([1i64])?.dropout(0.5, true), &["dropout", "int64"]);
        Ok(())
    })
}

// ---- cross_entropy ---------------------------------------------------------------------------

fn logits() -> Tensor {
    Tensor::new([[2.0f32, 1.0, 0.1], [0.5, 2.5, -1.0], [1.0, 1.0, 1.0], [-2.0, 0.0, 3.0]]).unwrap()
}

#[test]
fn cross_entropy_reductions_and_ignore_index() -> Result<()> {
    common::on_every_device(|| {
        let l = logits();
        let t = Tensor::new([0i64, 1, 2, -100])?;
        assert_close(&l.cross_entropy(&t, Some(-100), Reduction::Mean)?, DType::F32, &[], &[0.5562735199928284], 1e-6);
        assert_close(&l.cross_entropy(&t, Some(-100), Reduction::Sum)?, DType::F32, &[], &[1.6688205003738403], 1e-6);
        assert_close(
            &l.cross_entropy(&t, Some(-100), Reduction::None)?,
            DType::F32,
            &[4],
            &[0.4170299470424652, 0.15317824482917786, 1.0986123085021973, 0.0],
            1e-6,
        );
        let t2 = Tensor::new([0i64, 1, 2, 2])?;
        assert_close(&l.cross_entropy(&t2, None, Reduction::Mean)?, DType::F32, &[], &[0.43095141649246216], 1e-6);
        assert_close(&l.cross_entropy(&t2, Some(1), Reduction::Mean)?, DType::F32, &[], &[0.5235424637794495], 1e-6);
        // Every target ignored: 0 / 0.
        let all = Tensor::full(&[4], -100, DType::I64)?;
        assert_exact(&l.cross_entropy(&all, Some(-100), Reduction::Mean)?, DType::F32, &[], &[NAN]);
        // 1-D logits with a 0-d target.
        let one = l.i(0)?.cross_entropy(&Tensor::scalar(2, DType::I64)?, None, Reduction::Mean)?;
        assert_close(&one, DType::F32, &[], &[2.3170299530029297], 1e-6);
        // Results are fresh tensors, not views (PyTorch's `_base` is None).
        assert!(!l.i(0)?.cross_entropy(&Tensor::scalar(2, DType::I64)?, None, Reduction::None)?.is_view());
        // bf16 logits give a bf16 loss.
        let lb = l.to_dtype(DType::BF16)?.cross_entropy(&t, Some(-100), Reduction::Mean)?;
        assert_close(&lb, DType::BF16, &[], &[0.5546875], 8e-3);
        Ok(())
    })
}

#[test]
fn cross_entropy_with_extra_dims() -> Result<()> {
    common::on_every_device(|| {
        // logits [2, 3, 4] (classes on dim 1), target [2, 4].
        let l3 = Tensor::from_vec(
            vec![
                0.0f64,
                0.8414709568023682,
                0.9092974066734314,
                0.14112000167369843,
                -0.756802499294281,
                -0.9589242935180664,
                -0.279415488243103,
                0.6569865942001343,
                0.9893582463264465,
                0.41211849451065063,
                -0.5440211296081543,
                -0.9999902248382568,
                -0.5365729331970215,
                0.4201670289039612,
                0.9906073808670044,
                0.6502878665924072,
                -0.2879033088684082,
                -0.9613974690437317,
                -0.7509872317314148,
                0.14987720549106598,
                0.9129452705383301,
                0.8366556167602539,
                -0.008851309306919575,
                -0.8462203741073608,
            ],
            &[2, 3, 4],
        )?
        .to_dtype(DType::F32)?;
        let t3 = Tensor::new([[0i64, 1, 2, 1], [2, 2, 0, -100]])?;
        assert_close(
            &l3.cross_entropy(&t3, Some(-100), Reduction::Mean)?,
            DType::F32,
            &[],
            &[1.1073930263519287],
            1e-6,
        );
        assert_close(
            &l3.cross_entropy(&t3, Some(-100), Reduction::None)?,
            DType::F32,
            &[2, 4],
            &[
                1.4251958131790161,
                2.3971219062805176,
                1.8840656280517578,
                0.5809285640716553,
                0.42893558740615845,
                0.6015685200691223,
                0.43393558263778687,
                0.0,
            ],
            1e-6,
        );
        Ok(())
    })
}

#[test]
fn cross_entropy_errors() -> Result<()> {
    common::on_every_device(|| {
        let l = logits();
        assert_err(
            l.cross_entropy(&Tensor::new([0.0f32, 1.0, 2.0, 0.0])?, None, Reduction::Mean),
            &["cross_entropy", "float32"],
        );
        assert_err(l.cross_entropy(&Tensor::new([0i64, 1])?, None, Reduction::Mean), &["cross_entropy", "[4]", "[2]"]);
        assert!(l.cross_entropy(&Tensor::new([0i64, 1, 2, 3])?, None, Reduction::Mean).is_err());
        // PyTorch's strings parse into `Reduction`.
        let t = Tensor::new([0i64, 1, 2, 0])?;
        let by_name = l.cross_entropy(&t, None, "sum".parse()?)?;
        assert_exact(&by_name, DType::F32, &[], &f64s(&l.cross_entropy(&t, None, Reduction::Sum)?));
        assert_err("average".parse::<Reduction>(), &["reduction", "average"]);
        Ok(())
    })
}

#[test]
fn cross_entropy_label_smoothing_matches_pytorch() -> Result<()> {
    common::on_every_device(|| {
        // Values from F.cross_entropy(x, t, reduction=..., label_smoothing=0.15) in PyTorch 2.x.
        use kiln::tensor::CrossEntropy;
        let x = Tensor::new([[1.5f32, -0.5, 0.25, 2.0], [0.1, 0.2, -0.3, 0.4], [3.0, -1.0, 0.0, 0.5]])?;
        x.requires_grad_(true)?;
        let t = Tensor::new([3i64, -100, 0])?;
        let opts = |reduction| CrossEntropy { ignore_index: Some(-100), reduction, label_smoothing: 0.15 };
        let mean = x.cross_entropy_with(&t, opts(Reduction::Mean))?;
        assert_close(&mean.detach(), DType::F32, &[], &[0.6480802893638611], 1e-6);
        let sum = x.cross_entropy_with(&t, opts(Reduction::Sum))?;
        assert_close(&sum.detach(), DType::F32, &[], &[1.2961605787277222], 1e-6);
        let none = x.cross_entropy_with(&t, opts(Reduction::None))?;
        assert_close(&none.detach(), DType::F32, &[3], &[0.799985408782959, 0.0, 0.4961751699447632], 1e-6);
        mean.backward()?;
        let want = [
            0.14408667385578156,
            0.003287544474005699,
            0.0279034823179245,
            -0.1752777397632599,
            0.0,
            0.0,
            0.0,
            0.0,
            -0.00903833657503128,
            -0.010787976905703545,
            0.002893018303439021,
            0.01693330705165863,
        ];
        assert_close(&x.grad().expect("a gradient"), DType::F32, &[3, 4], &want, 1e-6);
        // PyTorch's range check.
        let bad = CrossEntropy { label_smoothing: 1.5, ..Default::default() };
        let err = x.cross_entropy_with(&t, bad).unwrap_err().to_string();
        assert!(err.contains("cross_entropy") && err.contains("label_smoothing must be between 0.0 and 1.0"), "{err}");
        Ok(())
    })
}

/// `set_default_device` (PyTorch's `torch.set_default_device`, thread-local):
/// new tensors given no device go there, scopes nest and restore, explicit
/// devices and other threads are unaffected.
#[test]
fn the_default_device_is_a_thread_scope() -> Result<()> {
    common::devices();
    let tpu = Device::Tpu(0);
    assert_eq!(kiln::tensor::default_device(), Device::Cpu);
    {
        let _on = kiln::tensor::set_default_device(tpu);
        assert_eq!(Tensor::new([1.0f32, 2.0])?.device(), tpu);
        assert_eq!(Tensor::from_vec(vec![1i64], &[1])?.device(), tpu);
        assert_eq!(Tensor::zeros(&[2], DType::I32)?.device(), tpu);
        assert_eq!(Tensor::arange(0.0, 3.0, 1.0, DType::F32)?.device(), tpu);
        assert_eq!(Tensor::ones(&[2], (DType::F32, Device::Cpu))?.device(), Device::Cpu, "an explicit device wins");
        {
            let _cpu = kiln::tensor::set_default_device(Device::Cpu);
            assert_eq!(Tensor::new([1.0f32])?.device(), Device::Cpu);
        }
        assert_eq!(Tensor::new([1.0f32])?.device(), tpu, "the outer scope comes back");
        let other = std::thread::spawn(|| Tensor::new([1.0f32]).unwrap().device()).join().unwrap();
        assert_eq!(other, Device::Cpu, "another thread keeps its own default");
    }
    assert_eq!(Tensor::new([1.0f32])?.device(), Device::Cpu);
    Ok(())
}
