"""Exercise 3.2's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

TREE = "tests/phase3/grade_3_2_halving_doubling.py"
MODEL = "tests/phase3/grade_3_2_model_alpha_beta.py"

QUESTIONS = {
    "3.2": [
        GradedQuestion(
            asks="At the halving step of distance d, which core rank is me's partner",
            wrong="the partner is core rank me + d, modulo p (not mutual: 1 pairs with 2, 2 "
            "with 3)",
            caught_by=f"{TREE}::test_halving_doubling_equals_dist_all_reduce[4]",
        ),
        GradedQuestion(
            asks="Which half of the current range does each of the two keep",
            wrong="both ranks of a pair keep the lower half",
            caught_by=f"{TREE}::test_halving_doubling_equals_dist_all_reduce[4]",
        ),
        GradedQuestion(
            asks="Where do both split a range of odd length",
            wrong="the rank keeping the upper half rounds the middle up, its partner down",
            caught_by=f"{TREE}::test_halving_doubling_equals_dist_all_reduce[4]",
        ),
        GradedQuestion(
            asks="in which order does doubling replay the steps",
            wrong="doubling replays the halving's steps in the same order, d = p/2 first",
            caught_by=f"{TREE}::test_halving_doubling_equals_dist_all_reduce[4]",
        ),
        GradedQuestion(
            asks="What does a folded rank do while the core runs, and from whom does it get the "
            "result",
            wrong="the partner of a folded rank never sends the result back",
            caught_by=f"{TREE}::test_halving_doubling_equals_dist_all_reduce[3]",
        ),
        GradedQuestion(
            asks="Which rank numbers does your partner rule work on",
            wrong="the partner rule applied to group ranks instead of core ranks",
            caught_by=f"{TREE}::test_halving_doubling_equals_dist_all_reduce[3]",
        ),
        GradedQuestion(
            asks="which do dst= and src= want",
            wrong="a partner's group rank passed as dst= and src= without peer",
            caught_by=f"{TREE}::test_halving_doubling_inside_a_group_of_three",
        ),
        GradedQuestion(
            asks="how many ranks run the halving and doubling, and how many steps does each "
            "half take among them",
            wrong="log2 of n steps each way, n not being a power of two",
            caught_by=f"{MODEL}::test_cost_counts_follow_the_table[halving_doubling]",
        ),
        GradedQuestion(
            asks="what are row i's two coefficients and its right-hand side",
            wrong="rows (m_i, v_i) with right-hand side t_i: plain least squares",
            caught_by=f"{MODEL}::test_fit_recovers_alpha_and_beta",
        ),
        GradedQuestion(
            asks="which one-unknown problem gives beta",
            wrong="alpha clamped to 0, beta kept from the two-unknown solution",
            caught_by=f"{MODEL}::test_a_clamped_fit_refits_the_other_unknown",
        ),
        GradedQuestion(
            asks="Which sets of measurements cannot tell alpha from beta",
            wrong="no check of the 2x2 system's determinant",
            caught_by=f"{MODEL}::test_fit_refuses_what_cannot_be_fitted",
        ),
    ],
}
