//! Rescaling without savepoints on the real broker, with input flowing: `instances` changed in the
//! config and the instances restarted, nothing else. Each instance slot keeps its state directory
//! (a StatefulSet's volume); new slots start on empty ones. Judged by Kafka's console consumer in
//! read_committed mode: none missing, none twice, order per partition kept.

mod common;

use std::time::{Duration, Instant};

use std::process::Child;

use common::bridge::*;
use common::scenario::*;
use common::*;

/// The instance slots of one bridge; slot i keeps its state directory across layouts.
struct Fleet {
    spec: BridgeSpec,
    homes: Vec<BridgeHome>,
    running: Vec<Option<Bridge>>,
}

impl Fleet {
    fn new(spec: BridgeSpec) -> Fleet {
        Fleet {
            spec,
            homes: Vec::new(),
            running: Vec::new(),
        }
    }

    /// Slot `instance`'s home, configured for a layout of `instances`.
    fn slot(&mut self, instance: u32, instances: u32) -> &BridgeHome {
        let i = instance as usize;
        while self.homes.len() <= i {
            self.homes.push(BridgeHome::new(self.spec.clone()));
            self.running.push(None);
        }
        let home = &mut self.homes[i];
        home.spec.instance = instance;
        home.spec.instances = instances;
        home
    }

    fn start(&mut self, instance: u32, instances: u32) {
        let bridge = self.slot(instance, instances).start(&[]);
        self.running[instance as usize] = Some(bridge);
    }

    /// A rolling update of one slot: SIGTERM, then a start with the new instance count. A fenced
    /// old process may already have stopped by itself (exit 1, naming the newer layout).
    fn restart(&mut self, instance: u32, instances: u32) {
        if let Some(mut b) = self.running[instance as usize].take() {
            b.sigterm();
            let _ = b.wait_exit(Duration::from_secs(30));
        }
        self.start(instance, instances);
    }

    fn stop(&mut self, instance: u32) {
        if let Some(mut b) = self.running[instance as usize].take() {
            assert!(
                b.stop_gracefully(Duration::from_secs(30)).success(),
                "{}",
                tail(&b.log_text(), 30)
            );
        }
    }

    fn bridges(&self) -> impl Iterator<Item = &Bridge> {
        self.running.iter().flatten()
    }

    /// Waits until every running instance of slots below `instances` reports `generation` and a checkpoint committed in it;
    /// returns how long that took.
    fn wait_layout(&self, generation: u64, instances: u32, began: Instant) -> Duration {
        let mut first: Vec<Option<u64>> = vec![None; self.running.len()];
        let ok = wait_until(Duration::from_secs(60), || {
            let slots = self.running.iter().take(instances as usize);
            slots.enumerate().all(|(i, b)| {
                let Some(b) = b else { return true };
                let Some(st) = b.status() else { return false };
                if st["layout_generation"].as_u64() != Some(generation)
                    || st["state"].as_str() != Some("running")
                {
                    return false;
                }
                let id = st["last_checkpoint_id"].as_u64().unwrap_or(0);
                let seen = *first[i].get_or_insert(id);
                id > seen
            })
        });
        assert!(
            ok,
            "the instances did not all commit in generation {generation}:\n{}",
            self.bridges()
                .map(|b| tail(&b.log_text(), 25))
                .collect::<Vec<_>>()
                .join("\n----\n")
        );
        began.elapsed()
    }

    fn committed_total(&self) -> i64 {
        self.bridges()
            .map(|b| b.committed_total().unwrap_or(0))
            .sum()
    }
}

/// A process of an older layout that stopped by itself: exit 1, naming the newer layout.
fn assert_fenced_by_newer_layout(b: &Bridge, status: std::process::ExitStatus) {
    assert!(!status.success(), "a fenced old instance exits 1");
    assert!(
        b.log_text().contains("newer layout"),
        "{}",
        tail(&b.log_text(), 20)
    );
}

/// 600 records on 6 partitions, bridged by one instance in layout 0; then `more` records arrive
/// at 150/s while the test changes the layout.
fn one_instance_under_load(name: &str, more: u64) -> (Scenario, Fleet, Child) {
    let s = Scenario::new(name, 6);
    s.produce(600, 1);
    let mut fleet = Fleet::new(s.home.spec.clone());
    fleet.start(0, 1);
    fleet.wait_layout(0, 1, Instant::now());
    let producer = s.produce_in_background(more, 150, 2);
    (s, fleet, producer)
}

/// Once the input is complete, waits until `fleet` has committed all of it, stops every instance
/// and judges the output. Returns the record count.
fn finish(s: &Scenario, fleet: &mut Fleet, mut producer: Child) -> i64 {
    assert!(producer.wait().unwrap().success());
    let total = s.input_total();
    assert!(
        wait_until(Duration::from_secs(60), || fleet.committed_total() == total),
        "committed {} of {total}",
        fleet.committed_total()
    );
    for i in 0..fleet.running.len() {
        fleet.stop(i as u32);
    }
    s.judge()
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for b in self.running.iter_mut().flatten() {
            b.kill9();
        }
    }
}

/// Changes the layout like a rolling update with a short overlap: the new layout's instances start
/// while the old ones still run, then the old ones that are not part of it stop.
fn change(fleet: &mut Fleet, from: u32, to: u32, generation: u64) -> Duration {
    let began = Instant::now();
    // Slots kept by both layouts restart with the new config; a fenced old process may already
    // have stopped by itself, which is the point.
    for i in 0..from.min(to) {
        fleet.restart(i, to);
    }
    for i in from..to {
        fleet.start(i, to);
    }
    let took = fleet.wait_layout(generation, to, began);
    for i in to..from {
        let b = fleet.running[i as usize].as_mut().unwrap();
        let status = b
            .wait_exit(Duration::from_secs(30))
            .expect("a removed instance is fenced and stops");
        assert_fenced_by_newer_layout(b, status);
        fleet.running[i as usize] = None;
    }
    took
}

#[test]
fn one_two_three_one_instances_by_config_change_and_restart_only() {
    let _serial = serial();
    let (s, mut fleet, producer) = one_instance_under_load("rs", 3000);
    let times = [
        change(&mut fleet, 1, 2, 1),
        change(&mut fleet, 2, 3, 2),
        change(&mut fleet, 3, 1, 3),
    ];
    let total = finish(&s, &mut fleet, producer);
    eprintln!("rescale 1->2->3->1: {total} records, each change until the new layout committed: {times:?}");
}

#[test]
fn an_old_layout_process_is_fenced_mid_epoch_and_a_kill_9_during_the_change_is_repaired() {
    let _serial = serial();
    let (s, mut fleet, producer) = one_instance_under_load("rs2", 2000);

    // Layout 2 side by side with layout 1 for a while; instance 1 of layout 2 is killed -9 right
    // after it took over and restarted.
    fleet.start(1, 2);
    assert!(wait_until(Duration::from_secs(60), || fleet.running[1]
        .as_ref()
        .unwrap()
        .log_text()
        .contains("taking over the partitions")));
    fleet.running[1].as_mut().unwrap().kill9();
    fleet.start(1, 2);
    // The old instance 0 keeps running until it is fenced by the new one's owner of its
    // partitions: both slots of layout 2 own some of them, so it stops by itself.
    let old = fleet.running[0].as_mut().unwrap();
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the fenced layout-1 process stops");
    assert_fenced_by_newer_layout(old, status);
    // The rolling update reaches slot 0 last: it restarts with the new count and joins layout 2.
    fleet.running[0] = None;
    fleet.start(0, 2);
    fleet.wait_layout(1, 2, Instant::now());
    finish(&s, &mut fleet, producer);
}

#[test]
fn layouts_two_and_three_side_by_side_then_the_old_one_killed() {
    let _serial = serial();
    let (s, mut old, producer) = one_instance_under_load("rs3", 2000);
    change(&mut old, 1, 2, 1);

    // Layout 3 on volumes of its own (another node pool, say) while layout 2 still runs.
    let began = Instant::now();
    let mut new = Fleet::new(s.home.spec.clone());
    for i in 0..3 {
        new.start(i, 3);
    }
    let took = new.wait_layout(2, 3, began);
    // The old layout had seconds side by side with the new one; whatever of it still runs is
    // killed -9 now, with whatever transaction it has open.
    let mut fenced_exits = 0;
    for b in old.running.iter_mut().flatten() {
        if let Ok(Some(status)) = b.child.try_wait() {
            assert_fenced_by_newer_layout(b, status);
            fenced_exits += 1;
        } else {
            b.kill9();
        }
    }
    old.running.clear();
    let total = finish(&s, &mut new, producer);
    eprintln!(
        "layouts 2 and 3 side by side: {total} records exactly once, layout 3 committed after \
         {took:?}, {fenced_exits} of 2 old instances had stopped by themselves"
    );
}

#[cfg(feature = "failpoints")]
#[test]
fn a_kill_9_at_every_step_of_a_take_over_is_repaired() {
    let _serial = serial();
    let (s, mut fleet, producer) = one_instance_under_load("rs4", 2000);
    change(&mut fleet, 1, 2, 1);

    // 2 -> 3: the new instance 2 dies (SIGKILL) at each step of its take-over in turn, while
    // instances 0 and 1 have already moved to layout 3; each restart repairs the last one.
    for i in 0..2 {
        fleet.restart(i, 3);
    }
    for step in ["after-intent", "after-fence", "after-takeover"] {
        let mut dying = fleet.slot(2, 3).start(&[("EOS_BRIDGE_FAILPOINT", step)]);
        let status = dying
            .wait_exit(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("failpoint {step} not reached:\n{}", dying.log_text()));
        assert!(!status.success(), "killed at {step}");
    }
    fleet.start(2, 3);
    let took = fleet.wait_layout(2, 3, Instant::now());
    let total = finish(&s, &mut fleet, producer);
    eprintln!("kill -9 at each take-over step: {total} records exactly once, final start {took:?}");
}
