//! The lowering of `Op::RandomBits`: Philox4x32-10 written out as integer
//! ops, so the device computes exactly the CPU kernel's bits (StableHLO's own
//! `rng_bit_generator` leaves its stream to the implementation). Every 32-bit
//! word is held in an int64 value in `[0, 2^32)`: the 32 x 32-bit products
//! fit the 64 bits (wrapping as unsigned arithmetic does), and the high word
//! is a logical shift away.
use super::{Builder, Lit, Val};
use kiln_tensor::DType;

const M0: i64 = 0xD251_1F53;
const M1: i64 = 0xCD9E_8D57;
const W0: i64 = 0x9E37_79B9;
const W1: i64 = 0xBB67_AE85;
const LOW: i64 = 0xFFFF_FFFF;

fn lit(b: &mut Builder, v: i64, like: &Val) -> Val {
    b.splat_like(Lit::I(v), like)
}

fn low32(b: &mut Builder, x: &Val) -> Val {
    let m = lit(b, LOW, x);
    b.and(x, &m)
}

fn high32(b: &mut Builder, x: &Val) -> Val {
    let s = lit(b, 32, x);
    b.binary("shift_right_logical", x, &s)
}

fn xor(b: &mut Builder, x: &Val, y: &Val) -> Val {
    b.binary("xor", x, y)
}

/// `(bits, new_state)` for the flat int64 `[2]` state `[key, offset]`: `shape`
/// random 32-bit words and `[key, offset + ceil(n / 4)]` (see `Op::RandomBits`).
pub fn random_bits(b: &mut Builder, state: &Val, shape: &[usize]) -> (Val, Val) {
    let n: usize = shape.iter().product();
    let blocks = n.div_ceil(4);
    let key = b.slice(state, &[0], &[1], &[1]);
    let offset = b.slice(state, &[1], &[2], &[1]);
    let advance = b.splat(Lit::I(blocks as i64), DType::I64, &[1]);
    let next_offset = b.add(&offset, &advance);
    let new_state = b.concat(&[&key, &next_offset], 0);
    if blocks == 0 {
        let none = b.splat(Lit::I(0), DType::I64, shape);
        return (none, new_state);
    }
    let bcast = |b: &mut Builder, x: &Val| b.broadcast(x, &[blocks], &[0]);
    // Block i's counter is offset + i: its low and high words, then two zeros.
    let idx = b.iota(&[blocks], 0, DType::I64);
    let off = bcast(b, &offset);
    let ctr = b.add(&idx, &off);
    let mut c = [low32(b, &ctr), high32(b, &ctr), lit(b, 0, &idx), lit(b, 0, &idx)];
    let mut k = [low32(b, &key), high32(b, &key)];
    for round in 0..10 {
        if round > 0 {
            for (ki, w) in k.iter_mut().zip([W0, W1]) {
                let inc = lit(b, w, ki);
                let s = b.add(ki, &inc);
                *ki = low32(b, &s);
            }
        }
        let (k0, k1) = (bcast(b, &k[0]), bcast(b, &k[1]));
        let m0 = lit(b, M0, &c[0]);
        let m1 = lit(b, M1, &c[2]);
        let p0 = b.mul(&m0, &c[0]);
        let p1 = b.mul(&m1, &c[2]);
        let (hi0, lo0, hi1, lo1) = (high32(b, &p0), low32(b, &p0), high32(b, &p1), low32(b, &p1));
        let x = xor(b, &hi1, &c[1]);
        let w0 = xor(b, &x, &k0);
        let y = xor(b, &hi0, &c[3]);
        let w2 = xor(b, &y, &k1);
        c = [w0, lo1, w2, lo0];
    }
    let cols: Vec<Val> = c.iter().map(|w| b.reshape(w, &[blocks, 1])).collect();
    let refs: Vec<&Val> = cols.iter().collect();
    let words = b.concat(&refs, 1);
    let flat = b.reshape(&words, &[blocks * 4]);
    let bits = b.slice(&flat, &[0], &[n], &[1]);
    (b.reshape(&bits, shape), new_state)
}
