"""Exercise 4.7's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

PIECES = "tests/phase4/grade_4_7_pieces.py"
DOORS = f"{PIECES}::test_tensor_parallel_regions_enter_and_leave_with_the_right_collectives"
COUNT = f"{PIECES}::test_count_valid_tokens_counts_the_whole_batch_once"
LOSS = f"{PIECES}::test_loss_share_is_the_ranks_sum_over_the_global_count"
BALANCE = f"{PIECES}::test_balance_loss_shares_add_up_to_one_process_balance_loss"
FINISH = f"{PIECES}::test_finish_gradients_reduces_each_gradient_on_its_groups"
HOOK = f"{PIECES}::test_finish_gradients_hands_the_data_parallel_sums_to_the_given_all_reduce"
TIE = f"{PIECES}::test_finish_gradients_sums_a_tie_so_both_copies_keep_the_same_bits"
PLACEMENTS = f"{PIECES}::test_gradient_placements_name_every_group_holding_copies"
TRAINING = "tests/phase4/grade_4_7_training.py::test_layout_trains_like_one_process"

QUESTIONS = {
    "4.7": [
        # sequence parallelism
        GradedQuestion(
            asks="Which of 2.6's operators and the module's two Functions does exactly that",
            wrong="the entrance without sequence parallelism is 2.6's g (a sum forward), not f",
            caught_by=DOORS,
        ),
        GradedQuestion(
            asks="with sequence parallelism, which tokens did this rank's copy see",
            wrong="the tp-replicated gradients never summed over tp, sequence parallelism or not",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="Without it",
            wrong="the tp-replicated gradients summed over tp without sequence parallelism too",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="What do the two rules then say about their gradients, and about the groups "
            "that the loss's sums over tokens run on",
            wrong="the balance loss's counts summed over cp only under sequence parallelism",
            caught_by=BALANCE,
        ),
        # the loss, in shares
        GradedQuestion(
            asks="Which ranks hold exactly the targets this rank holds, and which hold others",
            wrong="the count all-reduced over the whole world (tp and pp copies counted again)",
            caught_by=COUNT,
        ),
        GradedQuestion(
            asks="Summed over too many ranks, which targets count twice; over too few, which are missed",
            wrong="the count all-reduced over dp only (the cp shards' targets missed)",
            caught_by=COUNT,
        ),
        GradedQuestion(
            asks="does a mean of per-rank means equal one process's loss",
            wrong="F.cross_entropy's default mean over this rank's own valid targets",
            caught_by=LOSS,
        ),
        GradedQuestion(
            asks="What does each rank need to know about the others to do better, and which of "
            "your functions gave it",
            wrong="the summed cross-entropy divided by this rank's own count, not global_valid",
            caught_by=LOSS,
        ),
        GradedQuestion(
            asks="do they sum or average, and over which ranks",
            wrong="the share as a term of the sum: no factor for the average over dp x cp",
            caught_by=LOSS,
        ),
        GradedQuestion(
            asks="What must a share be for the gradient after that reduction to be one process's",
            wrong="the share multiplied by the dp size instead of the dp x cp size",
            caught_by=LOSS,
        ),
        GradedQuestion(
            asks="on the way back, are their parts summed or averaged",
            wrong="the share divided by the tp size as well",
            caught_by=LOSS,
        ),
        GradedQuestion(
            asks="What, then, does your share need to know about m",
            wrong="the share divided by m (the executor's division by m then counted twice)",
            caught_by=TRAINING,
        ),
        GradedQuestion(
            asks="which of the two needs the other ranks' tokens, over which groups, and does it "
            "carry a gradient",
            wrong="f from this rank's own counts, not summed over the cp group",
            caught_by=BALANCE,
        ),
        GradedQuestion(
            asks="Which is linear, so that each rank can add its own tokens' part",
            wrong="P of the whole sequence all-reduced over cp and used on every rank",
            caught_by=BALANCE,
        ),
        GradedQuestion(
            asks="If every rank holding tokens of a sequence added that whole sequence's loss, "
            "how many times would it count",
            wrong="P as the mean over this rank's own tokens (each rank adds a whole sequence's loss)",
            caught_by=BALANCE,
        ),
        GradedQuestion(
            asks="Which count of sequences divides at the end, and what keeps the mean right",
            wrong="the mean over this rank's own sequences, no dp x cp factor",
            caught_by=BALANCE,
        ),
        # after backward
        GradedQuestion(
            asks="Which other ranks hold a copy of this weight, or of this piece of it",
            wrong="the dense gradients averaged over dp only (the cp shards' copies left out)",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="Did those copies see other tokens",
            wrong="the tp-replicated gradients summed over tp without sequence parallelism",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="Does the answer change with sequence parallelism",
            wrong="the tp-replicated gradients not summed over tp under sequence parallelism",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="which count divides it: that group's size, or the number of ranks whose shares were scaled",
            wrong="the experts' sums divided by the edp group's size",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="Which gradients has something reduced already",
            wrong="the ZeRO slices averaged over dp x cp a second time",
            caught_by=FINISH,
        ),
        GradedQuestion(
            asks="Which of the sums are data-parallel, the ones all_reduce_fn is for",
            wrong="the tied embedding's sum handed to all_reduce_fn too",
            caught_by=HOOK,
        ),
        GradedQuestion(
            asks="In which order must the reductions run so that both copies still end with the same bits",
            wrong="the tie summed first, before the data-parallel sums",
            caught_by=TIE,
        ),
        GradedQuestion(
            asks="which ranks averaged or summed it together, and do they now hold the same "
            "tensor, or another slice of it",
            wrong="a ZeRO slice named as replicated on dp_cp",
            caught_by=PLACEMENTS,
        ),
        GradedQuestion(
            asks="Which further groups hold equal copies, with and without sequence parallelism",
            wrong="tp left out for a tp-replicated weight",
            caught_by=PLACEMENTS,
        ),
    ],
}
