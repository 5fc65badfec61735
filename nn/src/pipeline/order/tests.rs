//! The schedules' orders: complete, deadlock-free, with the bubble and the
//! in-flight activations their papers give.
use super::*;

fn check_complete(orders: &[Vec<Action>], p: usize, v: usize, m: usize) {
    for (r, order) in orders.iter().enumerate() {
        let mut seen = std::collections::HashSet::new();
        for a in order {
            assert_eq!(a.stage % p, r, "{a:?} is on rank {r}");
            assert!(seen.insert(*a), "{a:?} twice on rank {r}");
        }
        assert_eq!(seen.len(), 2 * v * m, "rank {r} runs each of its stages' F and B once per microbatch");
    }
}

#[test]
fn gpipe_and_1f1b_have_the_papers_bubble() {
    for (p, m) in [(2, 4), (4, 4), (4, 8), (3, 5), (4, 1)] {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let orders = rank_orders(kind, p, 1, m).unwrap();
            check_complete(&orders, p, 1, m);
            for tb in [1.0, 2.0] {
                let t = simulate(&orders, p, 1.0, tb).unwrap();
                let want = (p - 1) as f64 / (m + p - 1) as f64;
                assert!(
                    (t.bubble_fraction() - want).abs() < 1e-12,
                    "{kind:?} p={p} m={m} tb={tb}: {}",
                    t.bubble_fraction()
                );
            }
        }
    }
}

#[test]
fn interleaving_divides_the_bubble_by_the_stages_per_rank() {
    for (p, v, m) in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 2)] {
        let orders = rank_orders(ScheduleKind::Interleaved1F1B, p, v, m).unwrap();
        check_complete(&orders, p, v, m);
        let t = simulate(&orders, p * v, 1.0, 1.0).unwrap();
        // Megatron-LM: the bubble shrinks from (p - 1) to (p - 1) / v stage-microbatch times.
        let want = (p - 1) as f64 / (v * m + p - 1) as f64;
        assert!((t.bubble_fraction() - want).abs() < 1e-12, "p={p} v={v} m={m}: {} vs {want}", t.bubble_fraction());
        let plain = simulate(&rank_orders(ScheduleKind::OneFOneB, p, 1, m).unwrap(), p, 1.0, 1.0).unwrap();
        assert!(t.bubble_fraction() < plain.bubble_fraction());
    }
}

#[test]
fn one_f_one_b_holds_at_most_p_microbatches_and_gpipe_all() {
    let (p, m) = (4, 8);
    let peaks = peak_in_flight(&rank_orders(ScheduleKind::OneFOneB, p, 1, m).unwrap(), p);
    assert_eq!(peaks, vec![4, 3, 2, 1]);
    let peaks = peak_in_flight(&rank_orders(ScheduleKind::GPipe, p, 1, m).unwrap(), p);
    assert_eq!(peaks, vec![8; 4]);
}

#[test]
fn a_deadlocking_order_and_bad_shapes_are_errors() {
    let orders = vec![vec![Action::b(0, 0), Action::f(0, 0)], vec![Action::f(1, 0), Action::b(1, 0)]];
    let e = simulate(&orders, 2, 1.0, 1.0).unwrap_err().to_string();
    assert!(e.contains("deadlocks") && e.contains("rank 0"), "{e}");
    let e = rank_orders(ScheduleKind::Interleaved1F1B, 4, 2, 6).unwrap_err().to_string();
    assert!(e.contains("multiple of the ranks"), "{e}");
    assert!(rank_orders(ScheduleKind::OneFOneB, 2, 2, 4).is_err());
    assert!(rank_orders(ScheduleKind::GPipe, 2, 1, 0).is_err());
    assert!(ScheduleKind::parse("zb").is_err());
}
