"""Exercise 3.6's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase3/grade_3_6_parallel_3d.py"
CLIP = "tests/phase3/grade_3_6_clipping.py"
NORM = f"{CLIP}::test_clip_grad_norm_over_shards_equals_one_process"

QUESTIONS = {
    "3.6": [
        GradedQuestion(
            asks="which blocks must stage pp_rank hold for the pipeline to compute the dense model",
            wrong="blocks dealt round-robin: stage s holds blocks s, s + pp, ...",
            caught_by=f"{GRADER}::test_each_stage_holds_its_blocks_sharded_on_the_tp_group"
            "[dp1-tp2-pp2]",
        ),
        GradedQuestion(
            asks="On which of the topology's groups is each block sharded",
            wrong="ParallelMLP.from_dense on the default group (the world)",
            caught_by=f"{GRADER}::test_each_stage_holds_its_blocks_sharded_on_the_tp_group"
            "[dp2-tp2-pp1]",
        ),
        GradedQuestion(
            asks="which coordinate of this rank picks its slice of the batch, and which ranks "
            "must see the same samples",
            wrong="the global rank modulo dp picks the slice",
            caught_by=f"{GRADER}::test_each_replica_runs_its_own_slice_in_microbatches"
            "[dp2-tp2-pp1]",
        ),
        GradedQuestion(
            asks="Which ranks hold a copy of the same shard, and so over which group are the "
            "gradients averaged",
            wrong="average_gradients over the world",
            caught_by=f"{GRADER}::test_three_steps_equal_one_process_on_the_whole_batch"
            "[dp2-tp2-pp1]",
        ),
        GradedQuestion(
            asks="is the gradients' sum over that group divided, and by how many",
            wrong="the gradients summed over the dp group, not divided",
            caught_by=f"{GRADER}::test_three_steps_equal_one_process_on_the_whole_batch"
            "[dp2-tp2-pp1]",
        ),
        GradedQuestion(
            asks="What does .grad hold when the step starts",
            wrong="the gradients never zeroed between steps",
            caught_by=f"{GRADER}::test_three_steps_equal_one_process_on_the_whole_batch"
            "[dp2-tp2-pp1]",
        ),
        GradedQuestion(
            asks="which one rank of each set of copies counts it, decided from its own place alone",
            wrong="counted when this rank is index 0 in any one of the named groups",
            caught_by=f"{CLIP}::test_counted_here_counts_every_set_of_copies_once",
        ),
        GradedQuestion(
            asks="which groups hold other pieces of the model, and so must contribute",
            wrong="the part reduced over the pp and tp groups only",
            caught_by=f"{NORM}[3D,(dp,tp,pp)=(2,2,1)]",
        ),
        GradedQuestion(
            asks="What reduction combines the parts for a finite p, and for inf",
            wrong="the inf-norm's parts summed (ReduceOp.SUM)",
            caught_by=f"{NORM}[3D,(dp,tp,pp)=(2,2,1)]",
        ),
        GradedQuestion(
            asks="Where is the p-th root taken",
            wrong="the root taken on each rank's part before the all-reduces",
            caught_by=f"{NORM}[3D,(dp,tp,pp)=(1,2,2)]",
        ),
    ],
}
