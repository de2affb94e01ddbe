"""Exercise 4.1's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

CHECKPOINT = "tests/phase4/grade_4_1_checkpoint.py"
DAMAGE = "tests/phase4/grade_4_1_damage.py"

QUESTIONS = {
    "4.1": [
        GradedQuestion(
            asks="where must the temporary file live for the last step to be a rename and not a copy",
            wrong="the temporary file made by tempfile.mkstemp in the default temporary folder",
            caught_by=f"{CHECKPOINT}::test_the_temporary_file_is_renamed_in_the_same_directory",
        ),
        GradedQuestion(
            asks="where can the bytes still sit, and which call moves them on from each place",
            wrong="os.fsync of the descriptor without flushing the file object first",
            caught_by=f"{CHECKPOINT}::test_the_bytes_are_on_the_disk_before_the_rename_and_the_rename_after_it",
        ),
        GradedQuestion(
            asks="In which order must writing, making durable and renaming come",
            wrong="os.replace onto the target first, then os.fsync of the file",
            caught_by=f"{CHECKPOINT}::test_the_bytes_are_on_the_disk_before_the_rename_and_the_rename_after_it",
        ),
        GradedQuestion(
            asks="Once the rename returns, is it on the disk itself",
            wrong="no fsync_directory of the target's folder after the rename",
            caught_by=f"{CHECKPOINT}::test_the_bytes_are_on_the_disk_before_the_rename_and_the_rename_after_it",
        ),
        GradedQuestion(
            asks="When write(f) raises, what must your function do before the error goes on",
            wrong="the temporary file left in the folder (or the error swallowed)",
            caught_by=f"{CHECKPOINT}::test_a_write_that_dies_half_way_leaves_the_old_file_whole",
        ),
        GradedQuestion(
            asks="which of the checks answers without reading a file's bytes, which one reads every byte",
            wrong="the sha256 compared before the size: a truncated file reported as corrupted",
            caught_by=f"{CHECKPOINT}::test_a_damaged_newest_checkpoint_is_skipped_with_a_reason",
        ),
        GradedQuestion(
            asks="Which of the manifest's contents may you read before read_manifest has accepted it",
            wrong="manifest.json parsed with json.loads and its entries read directly",
            caught_by=f"{DAMAGE}::test_every_byte_flip_and_cut_of_a_manifest_falls_back_to_the_older_checkpoint",
        ),
        GradedQuestion(
            asks="in which order are the folders tried, and when may the search stop",
            wrong="the folders tried oldest first (or the search ended at the first invalid one)",
            caught_by=f"{CHECKPOINT}::test_a_damaged_newest_checkpoint_is_skipped_with_a_reason",
        ),
        GradedQuestion(
            asks="which generators can a training step draw from, and which of their states would",
            wrong="NumPy's generator left out, or its native state (a tuple with an ndarray) saved",
            caught_by=f"{CHECKPOINT}::test_each_ranks_rng_comes_back_from_its_own_keys_through_weights_only",
        ),
        GradedQuestion(
            asks="which keys are rank 1's, and which only look like them",
            wrong="the keys selected by the prefix rank1 without its slash",
            caught_by=f"{CHECKPOINT}::test_rng_keys_of_12_ranks_never_mix_ranks",
        ),
    ],
}
