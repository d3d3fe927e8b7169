from lightning_greedysnake.planner import Machine, UnitCost, predict, traffic

UNITS = [UnitCost(0.01, 0.03, weight_bytes=4096 * 10, grad_bytes=4096 * 10, master_bytes=0,
                  state_bytes=2 * 4096 * 10, params=10_000) for _ in range(4)]
FAST_DISK = Machine(read_bytes_per_s=1e12, write_bytes_per_s=1e12, optimizer_elements_per_s=1e12)


def test_vertical_weight_traffic_does_not_grow_with_k_and_horizontal_does():
    v = [traffic(UNITS, "vertical", k).terms["read/weights"] for k in (1, 4, 16)]
    h = [traffic(UNITS, "horizontal", k).terms["read/weights"] for k in (1, 4, 16)]
    assert v[0] == v[1] == v[2]
    assert h[0] == v[0] and h[1] < h[2] and h[2] > 10 * v[2]
    assert "read/gradients" not in traffic(UNITS, "vertical", 8).terms
    assert traffic(UNITS, "horizontal", 8).terms["read/gradients"] > 0


def test_the_bound_is_whichever_term_is_largest():
    compute_bound = predict(UNITS, FAST_DISK, "vertical", 8)
    assert compute_bound.bound == "compute" and compute_bound.step_s == compute_bound.compute_s
    slow_disk = Machine(read_bytes_per_s=1e5, write_bytes_per_s=1e5, optimizer_elements_per_s=1e12)
    assert predict(UNITS, slow_disk, "vertical", 8).bound == "ssd"
    slow_cpu = Machine(read_bytes_per_s=1e12, write_bytes_per_s=1e12, optimizer_elements_per_s=1e3)
    assert predict(UNITS, slow_cpu, "vertical", 8).bound == "optimizer"
    # compute grows with K, SSD traffic does not (vertical): a disk-bound step becomes compute-bound
    one, many = predict(UNITS, slow_disk, "vertical", 1), predict(UNITS, slow_disk, "vertical", 10_000)
    assert one.ssd_s == many.ssd_s and many.compute_s == 10_000 * one.compute_s


def test_on_shared_cores_the_optimizer_adds_to_the_compute():
    """A CPU run: the optimizer's kernels take the model's cores, so its time adds to the compute's
    rather than racing it (at the training thread's rate, the faster one here)."""
    slow = dict(read_bytes_per_s=1e12, write_bytes_per_s=1e12, optimizer_elements_per_s=1e5)
    apart = predict(UNITS, Machine(**slow), "vertical", 8)
    shared = predict(UNITS, Machine(**slow, inline_optimizer_elements_per_s=2e5, shared_cores=True), "vertical", 8)
    assert shared.optimizer_s == sum(u.params for u in UNITS) / 2e5 < apart.optimizer_s
    assert shared.compute_s == apart.compute_s + shared.optimizer_s and shared.bound == "compute"
    assert shared.step_s > max(apart.compute_s, shared.optimizer_s)


def test_reads_and_writes_sum_their_terms():
    t = traffic(UNITS, "horizontal", 3, clip_norm=False)
    assert t.read_bytes == sum(v for n, v in t.terms.items() if n.startswith("read/"))
    assert t.write_bytes == sum(v for n, v in t.terms.items() if n.startswith("write/"))


def test_frozen_weights_are_read_with_their_unit_and_never_written():
    """Issue 70: a unit whose trained prefix is a tenth of its weights (a LoRA block) reads its whole weights
    region for compute and writes the prefix back; merged units and the warm-step plan's step bytes agree."""
    import dataclasses

    from lightning_greedysnake.planner.plan import merge, optimizer_bytes

    lora = [dataclasses.replace(u, trained_weight_bytes=4096) for u in UNITS]
    whole, frozen = traffic(UNITS, "vertical", 4).terms, traffic(lora, "vertical", 4).terms
    assert frozen["read/weights"] == whole["read/weights"]
    assert whole["write/weights"] == 4 * 4096 * 10 and frozen["write/weights"] == 4 * 4096
    assert merge(lora, 2)[0].written_weight_bytes == 2 * 4096 and merge(UNITS, 2)[0].written_weight_bytes == 2 * 40960
    assert optimizer_bytes(lora[1])[1] - optimizer_bytes(lora[1])[0] == 4096
    clipped = traffic(lora, "vertical", 4, clip_norm=True).terms  # (32-true: the prefix re-read as master)
    assert clipped["read/master_weights"] == 4 * 4096
    assert dataclasses.replace(UNITS[0], params=0).written_weight_bytes == 0
