"""Exercise 4.2's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase4/grade_4_2_recovery.py"

QUESTIONS = {
    "4.2": [
        GradedQuestion(
            asks="does the step the event reports belong to the epoch progress is counting",
            wrong="the step's samples always added to progress's position, whatever its epoch",
            caught_by=f"{GRADER}::test_advance_counts_samples_and_rolls_over_at_the_end_of_an_epoch",
        ),
        GradedQuestion(
            asks="If not, where does the count start",
            wrong="a step of a new epoch starts the count at 0 instead of its own samples",
            caught_by=f"{GRADER}::test_advance_counts_samples_and_rolls_over_at_the_end_of_an_epoch",
        ),
        GradedQuestion(
            asks="When the count reaches epoch_samples, where must a resumed run begin",
            wrong="the same epoch at position epoch_samples (an empty epoch on resume)",
            caught_by=f"{GRADER}::test_advance_counts_samples_and_rolls_over_at_the_end_of_an_epoch",
        ),
        GradedQuestion(
            asks="so who looks, and how do the others learn the answer",
            wrong="every rank asks latest_valid for itself, nothing broadcast",
            caught_by=f"{GRADER}::test_every_rank_resumes_from_the_checkpoint_rank_0_chose",
        ),
        GradedQuestion(
            asks="dist.broadcast names its source by global rank: which is it when group is a subgroup",
            wrong="src=0 whatever the group",
            caught_by=f"{GRADER}::test_resume_on_a_subgroup_takes_its_rank_0s_choice_and_each_ranks_own_generators",
        ),
        GradedQuestion(
            asks="restore_rng takes a rank: this process's rank in group, or its global rank",
            wrong="restore_rng with the rank in the group",
            caught_by=f"{GRADER}::test_resume_on_a_subgroup_takes_its_rank_0s_choice_and_each_ranks_own_generators",
        ),
    ],
}
