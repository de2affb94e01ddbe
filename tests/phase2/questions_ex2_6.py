"""Exercise 2.6's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision."""

from question_grading import GradedQuestion

GRADER = "tests/phase2/grade_2_6_tensor_parallel.py"

QUESTIONS = {
    "2.6": [
        GradedQuestion(
            asks="what part of dL/dx does one rank's grad_output hold, and what must f's backward "
            "return",
            wrong="f's backward returns grad_output as it is, with no all-reduce",
            caught_by=f"{GRADER}::test_megatron_f_and_g_operators",
        ),
        GradedQuestion(
            asks="what is the gradient of one rank's term of the sum, and does g's backward need "
            "another rank's values",
            wrong="g's backward all-reduces grad_output too (all-reduce both ways)",
            caught_by=f"{GRADER}::test_megatron_f_and_g_operators",
        ),
        GradedQuestion(
            asks="in g's forward, whose tensor is that if you hand it the input",
            wrong="g's forward all-reduces the caller's input in place and returns it",
            caught_by=f"{GRADER}::test_megatron_f_and_g_operators",
        ),
        GradedQuestion(
            asks="by which rank is that part picked: this rank's rank in group, or in the world",
            wrong="the gather's backward slices grad_output by dist.get_rank(), the world's rank",
            caught_by=f"{GRADER}::test_tensor_parallel_blocks_work_inside_a_group_and_stay_there",
        ),
        GradedQuestion(
            asks="on which group does each collective run",
            wrong="g's all-reduce called without group=, on the whole world",
            caught_by=f"{GRADER}::test_tensor_parallel_blocks_work_inside_a_group_and_stay_there",
        ),
        GradedQuestion(
            asks="which dimension of W lists a column-parallel layer's output features",
            wrong="column_shard cuts the weight's second dimension (its input features)",
            caught_by=f"{GRADER}::test_column_shard_takes_this_ranks_rows_of_each_fused_part",
        ),
        GradedQuestion(
            asks="which one a row-parallel layer's input features",
            wrong="row_shard cuts the weight's first dimension (its output features)",
            caught_by=f"{GRADER}::test_row_shard_takes_this_ranks_input_features",
        ),
        GradedQuestion(
            asks="what must happen to x's gradient on the way back, and which operator does it",
            wrong="ColumnParallelLinear.forward without f: F.linear on x directly",
            caught_by=f"{GRADER}::test_column_parallel_linear_equals_the_dense_layer",
        ),
        GradedQuestion(
            asks="with gather_output, which operator turns this rank's slice into the whole output",
            wrong="gather_output ignored: this rank's slice returned either way",
            caught_by=f"{GRADER}::test_column_parallel_linear_equals_the_dense_layer",
        ),
        GradedQuestion(
            asks="what turns it into y on every rank",
            wrong="RowParallelLinear.forward returns the local product, with no g",
            caught_by=f"{GRADER}::test_row_parallel_linear_equals_the_dense_layer",
        ),
        GradedQuestion(
            asks="when x is not already a slice, how do you cut it so that its gradient comes back "
            "whole",
            wrong="x cut with last_dim_slice (a plain slice) instead of the scatter",
            caught_by=f"{GRADER}::test_row_parallel_linear_equals_the_dense_layer",
        ),
        GradedQuestion(
            asks="where does the bias go so that the output holds it once and every copy of it "
            "gets the full gradient",
            wrong="the bias added to every rank's partial sum before g (also planted: on rank 0 "
            "only before g; b / n on every rank before g)",
            caught_by=f"{GRADER}::test_row_parallel_bias_is_added_once_and_every_copy_learns",
        ),
        GradedQuestion(
            asks="which options of fc1 and fc2 make the block need one all-reduce in forward, one "
            "in backward, and nothing between the two layers",
            wrong="fc1 with gather_output=True and fc2 with input_is_parallel=False",
            caught_by=f"{GRADER}::test_parallel_mlp_equals_dense_with_one_all_reduce_each_way",
        ),
        GradedQuestion(
            asks="which fused_parts gives this rank the q, k and v rows of its own heads",
            wrong="qkv built with fused_parts=1: a contiguous block of in_proj_weight's rows",
            caught_by=f"{GRADER}::test_parallel_attention_splits_heads_and_equals_dense",
        ),
        GradedQuestion(
            asks="how do you turn it into q, k and v of shape [batch, local heads, seq, head_dim], "
            "and the attention's result back into the layout out_proj reads",
            wrong="qkv's output viewed as (batch, seq, local heads, 3, head_dim) (also planted: "
            "the heads reshaped back without moving them after seq)",
            caught_by=f"{GRADER}::test_parallel_attention_splits_heads_and_equals_dense",
        ),
    ],
}
