//! `random_bits`: Philox4x32-10 (Salmon et al., "Parallel random numbers: as
//! easy as 1, 2, 3", SC 2011), the counter-based generator behind kiln's
//! generators (see `Op::RandomBits`). Counter-based, so blocks are computed
//! independently, in parallel.
use super::iter::fork_chunks;
use super::Input;
use kiln_tensor::{Error, HostBuffer, Result};

const M0: u64 = 0xD251_1F53;
const M1: u64 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// The four 32-bit words of Philox4x32-10 for counter `c` under key `k`.
pub(crate) fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// Blocks per parallel task.
const CHUNK_BLOCKS: usize = 1 << 14;

/// The bits of `numel` elements and the advanced state, for the state `[key, offset]`.
pub(crate) fn random_bits(state: &Input<'_>, numel: usize) -> Result<Vec<HostBuffer>> {
    let st = state.slice::<i64>()?;
    let l = state.layout;
    if l.numel() != 2 {
        return Err(Error::backend("cpu", "random_bits: the generator state must have 2 elements"));
    }
    let (key, offset) = (st[l.offset()] as u64, st[l.offset() + l.strides()[0]] as u64);
    let k = [key as u32, (key >> 32) as u32];
    let blocks = numel.div_ceil(4);
    let mut out = vec![0i64; numel];
    fork_chunks(&mut out, CHUNK_BLOCKS * 4, 1, &|ci, chunk| {
        for (bi, words) in chunk.chunks_mut(4).enumerate() {
            let b = offset.wrapping_add((ci * CHUNK_BLOCKS + bi) as u64);
            let r = philox4x32_10([b as u32, (b >> 32) as u32, 0, 0], k);
            for (o, w) in words.iter_mut().zip(r) {
                *o = w as i64;
            }
        }
    });
    let next = vec![key as i64, offset.wrapping_add(blocks as u64) as i64];
    Ok(vec![HostBuffer::I64(out), HostBuffer::I64(next)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One generator drawn from by every thread of the pool and by a thread
    /// outside it, whose large draws fork the kernel into the pool. Were the
    /// generator's lock held across the kernel, the pool's threads would wait
    /// for the lock while the lock's holder waits for them to run its kernel
    /// (Note [Generators]). The draws must end, and give disjoint numbers.
    #[test]
    fn draws_from_the_pool_and_outside_it_do_not_deadlock() {
        crate::register();
        let g = kiln_tensor::Generator::new(kiln_tensor::Device::Cpu).unwrap().manual_seed(7).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let draws = |g: &kiln_tensor::Generator, n: usize, times: usize| -> Vec<i64> {
            (0..times).map(|_| g.random_bits(&[n]).unwrap().to_vec::<i64>().unwrap()[0]).collect()
        };
        let (small, large) = (64, 16 * CHUNK_BLOCKS * 4);
        {
            let (g, tx) = (g.clone(), tx.clone());
            std::thread::spawn(move || tx.send(draws(&g, large, 20)).unwrap());
        }
        for _ in 0..rayon::current_num_threads() {
            let (g, tx) = (g.clone(), tx.clone());
            rayon::spawn(move || tx.send(draws(&g, small, 2000)).unwrap());
        }
        drop(tx);
        let mut firsts = Vec::new();
        for _ in 0..rayon::current_num_threads() + 1 {
            let got = rx
                .recv_timeout(std::time::Duration::from_secs(60))
                .expect("draws did not finish: the generator's lock was held across a parallel kernel");
            firsts.extend(got);
        }
        let total = firsts.len();
        firsts.sort_unstable();
        firsts.dedup();
        assert_eq!(firsts.len(), total, "two draws started at the same counter");
    }

    #[test]
    fn philox_matches_the_known_answer_vectors() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }
}
