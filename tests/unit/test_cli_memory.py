"""``sftjob plan`` on pod memory: node rank 0's pod and the other nodes', what the pods of a job allowed on
several cards ask for, and a user's memory below what a card's plan needs."""

import json

from tests.unit.test_cli import run


def test_a_sharded_multi_node_plan_shows_the_memory_of_node_rank_zeros_pod_and_of_the_others(capsys):
    flags = ["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--method", "full", "--gpu", "A800-SXM4-80GB"]
    code, out, _ = run(capsys, *flags, "--gpus", "4", "--nodes", "2")
    assert code == 0
    assert "72Gi (node rank 0), 64Gi (other nodes)" in out
    code, out, _ = run(capsys, *flags, "--gpus", "4", "--nodes", "2", "-o", "json")
    (plan,) = json.loads(out)
    assert (plan["podMemory"], plan["podMemoryOtherNodes"]) == ("72Gi", "64Gi")
    code, out, _ = run(capsys, *flags, "--gpus", "4", "-o", "json")
    (plan,) = json.loads(out)
    assert (plan["podMemory"], plan["podMemoryOtherNodes"]) == ("72Gi", None)


def test_a_users_memory_below_what_any_candidate_card_needs_is_warned_about(tmp_path, capsys):
    # 14B LoRA on 8 GPUs: replicated on the A800s (88Gi), sharded on the 48 GB cards (rank 0 loads on CPU).
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: sftjob.io/v1alpha1\nkind: SFTJob\nmetadata: {name: j}\nspec:\n"
        "  model: {name: Qwen/Qwen2.5-14B-Instruct}\n  dataset: {name: org/chats}\n  method: lora\n"
        "  gpu: {type: Any, count: 8}\n  resources: {memory: 96Gi}\n"
    )
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 0
    assert "spec.resources.memory 96Gi is below the planned 104Gi per pod on A40" in err


def test_the_table_says_what_the_pods_of_a_job_allowed_on_several_cards_ask_for(capsys):
    flags = [
        "--model",
        "Qwen/Qwen2.5-14B",
        "--method",
        "lora",
        "--gpu",
        "Any",
        "--gpus",
        "2",
        "--seq",
        "4096",
    ]
    code, out, _ = run(capsys, "plan", *flags)
    assert code == 0
    assert "pods of a job allowed on these cards ask for 56Gi wherever they land" in out  # the A800s' 56Gi
